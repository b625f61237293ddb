"""The trainer's errors: one base type; ConfigError for anything knowable before training."""

from __future__ import annotations

__all__ = ["TrainerError", "ConfigError", "CheckpointError"]


class TrainerError(Exception):
    """Base of every error the trainer raises on purpose."""

    @classmethod
    def closed(cls, what: str) -> TrainerError:
        """fit(), eval() or predict() after close(): it would run unseen by every callback."""
        return cls(f"{what}() on a closed Trainer: close() ended its event stream, control "
                   "channel and callback workers; build a new Trainer (load_path= resumes "
                   "from a checkpoint)")


class ConfigError(TrainerError, ValueError):
    """A bad argument to Trainer: names the argument, the value, and what would be valid."""


class CheckpointError(TrainerError):
    """A checkpoint that could not be written or read."""
