"""`log_metrics()`: scalars logged by code in the training process itself (a model's
forward or loss, a data pipeline) travel with the run's own snapshots.

Values are held, not published, when logged: a step's go out with its `batch_end` (under
`metrics`), an evaluation's with its `eval_end` (beside the eval metrics), a prediction's
with `predict_end`. A 0-d tensor is kept as the loss is (on the CPU a number at once; on
CUDA the tensor, copied off the GPU with the snapshot, never a sync). They go to the
Trainer built last in this process (an error once it is closed, never an older one):
training code has no handle on the Trainer, and one process trains with one at a time.
"""

from __future__ import annotations

import numbers
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch

from offloop.trainer.errors import TrainerError

__all__ = ["UserMetrics", "log_metrics"]

_latest: weakref.ref | None = None  # the UserMetrics of the Trainer built last


class UserMetrics:
    """One Trainer's metrics logged since its last snapshot took them; log_metrics() goes
    to the one opened last."""

    def __init__(self, host: Callable[[torch.Tensor], Any]) -> None:
        self._host = host
        self.values: dict[str, Any] = {}
        self.closed = False

    def open(self) -> None:
        """From now on log_metrics() goes here (until another is opened, or this one closed)."""
        global _latest
        _latest = weakref.ref(self)

    def log(self, metrics: Mapping[str, Any]) -> None:
        if not isinstance(metrics, Mapping):
            raise TrainerError(
                f"log_metrics() takes a dict of name -> number, got {type(metrics).__name__}"
            )
        staged = {}
        for name, value in metrics.items():
            if not isinstance(name, str) or not name:
                raise TrainerError(
                    f"log_metrics(): metric names are non-empty strings, got {name!r}"
                )
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    raise TrainerError(
                        f"log_metrics(): {name!r} is a tensor of shape {tuple(value.shape)}; "
                        "log a scalar (a 0-d or one-element tensor)"
                    )
                staged[name] = self._host(value.detach().reshape(()))
            elif isinstance(value, numbers.Real) and not isinstance(value, bool):
                staged[name] = float(value)
            else:
                raise TrainerError(
                    f"log_metrics(): {name!r} is {type(value).__name__}; log a number or "
                    "a 0-d tensor"
                )
        self.values.update(staged)  # all or nothing: one bad value logs none of them

    def take(self) -> dict[str, Any]:
        """The values logged since the last take (the latest of each name), or {}."""
        values, self.values = self.values, {}
        return values

    def close(self) -> None:
        self.closed = True


def log_metrics(metrics: Mapping[str, Any]) -> None:
    """Log scalars from training code: `log_metrics({"aux/penalty": penalty})`. They reach
    callbacks (`state.train_metrics` at batch_end; beside `state.eval_metrics` during an
    evaluation), so an EarlyStopper can monitor them, and the Prometheus exporter."""
    target = _latest() if _latest is not None else None
    if target is None or target.closed:
        raise TrainerError(
            "log_metrics() needs a Trainer: build one (and do not close it) before "
            "training code logs; it goes to the one built last"
        )
    target.log(metrics)
