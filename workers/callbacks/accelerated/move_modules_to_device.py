"""`MoveModulesToDeviceCallback`: refuses to be created, saying why a worker cannot move modules."""

from __future__ import annotations

from typing import Any

from offloop.workers.callbacks.accelerated.adapter import OutOfProcessError, TrainerCallback

__all__ = ["MoveModulesToDeviceCallback"]


class MoveModulesToDeviceCallback(TrainerCallback):
    """Cannot run out of process: instantiating it raises OutOfProcessError (see the message)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise OutOfProcessError(
            "MoveModulesToDeviceCallback cannot run in an offloop worker: callbacks run in "
            "another process that receives read-only snapshots of the run, so a worker cannot "
            "reach the trainer's nn.Module attributes, let alone move them to its device. "
            "offloop's Trainer moves the model to its device itself (Trainer(device=...)); move any "
            "other module the loop uses (e.g. an nn.Module loss_fn with buffers) to that device "
            "before passing it to the Trainer, and drop this callback from the list."
        )
