"""`TerminateOnNaNCallback`: halts the run after a NaN or infinite loss, in training or evaluation."""

from __future__ import annotations

import math
from typing import Any

from offloop.workers.callback import StopTrainingError
from offloop.workers.callbacks.accelerated.adapter import TrainerCallback

__all__ = ["TerminateOnNaNCallback"]


class TerminateOnNaNCallback(TrainerCallback):
    """Halts the run after a NaN or infinite loss in training or evaluation.

    Training losses are checked at every step; evaluation losses at every step when the
    trainer publishes them, and always as the evaluation's mean loss (which one NaN batch
    makes NaN). `triggered_in` ('training' or 'validation') and `triggered_at` (the trainer's
    batch count) say where. Unlike pytorch-accelerated it does not sys.exit() at the end of
    the run: the worker is not the training process; the run's `stopped_by` records the halt.
    """

    triggered = False
    triggered_in: str | None = None
    triggered_at: int | None = None

    def __init__(self) -> None:
        self.triggered = False
        self.triggered_in: str | None = None
        self.triggered_at: int | None = None

    def on_training_run_start(self, trainer, **kwargs):
        self.triggered, self.triggered_in, self.triggered_at = False, None, None

    def check_for_nan_after_batch(self, batch_output, step=None):
        """Raise StopTrainingError if the loss in `batch_output` is NaN or infinite."""
        loss = batch_output.get("loss")
        if loss is not None and not _finite(loss):
            self.triggered, self.triggered_in = True, step
            raise StopTrainingError(f"Stopping training due to NaN loss in {step} step")

    def on_train_step_end(self, trainer, batch_output, **kwargs):
        self._check(trainer, batch_output, "training")

    def on_eval_step_end(self, trainer, batch_output, **kwargs):
        self._check(trainer, batch_output, "validation")

    def on_eval_epoch_end(self, trainer, dataloader_label=None, **kwargs):
        metrics = trainer.state.eval_metrics.get(dataloader_label or trainer.state.dataloader_label) or {}
        self._check(trainer, {"loss": metrics.get("loss")}, "validation")

    def _check(self, trainer, batch_output, step: str) -> None:
        if self.triggered:  # one halt per run, however many NaN batches are still in flight
            return
        self.triggered_at = trainer.state.timestamp.batch
        self.check_for_nan_after_batch(batch_output, step=step)


def _finite(value: Any) -> bool:
    if hasattr(value, "isfinite") or hasattr(value, "numel"):
        import torch

        return bool(torch.isfinite(torch.as_tensor(value)).all())
    return math.isfinite(float(value))
