"""`EarlyStoppingCallback`: stops training when a run-history metric stops improving.

Promise: pytorch-accelerated's rule, decided once per epoch after its evaluation.
"""

from __future__ import annotations

from typing import Any

from offloop.workers.callback import StopTrainingError
from offloop.workers.callbacks.accelerated._watch import NewValues, better, check_watch
from offloop.workers.callbacks.accelerated.adapter import TrainerCallback

__all__ = ["EarlyStoppingCallback"]


class EarlyStoppingCallback(TrainerCallback):
    """Stops training when `watch_metric` stops improving; pytorch-accelerated's semantics.

    It decides once per epoch, after the epoch's training and evaluation
    (`on_training_run_epoch_end`, as pytorch-accelerated does), so it can watch
    `train_loss_epoch` with no eval dataloader. Patience counts epochs that brought a new
    value of `watch_metric` without an improvement of more than `early_stopping_threshold`
    (an absolute change) over the best value so far; the first value is the first best. When
    the count reaches `early_stopping_patience`, it raises StopTrainingError, so the worker
    halts the run; `stopped_epoch` and `stopped_step` record where it decided, and
    `halt_ack` the step at which the trainer stopped.
    """

    def __init__(self, early_stopping_patience: int = 1, early_stopping_threshold: float = 0.01,
                 watch_metric: str = "eval_loss_epoch", greater_is_better: bool = False,
                 reset_on_train: bool = True) -> None:
        if isinstance(early_stopping_patience, bool) or not isinstance(early_stopping_patience, int) \
                or early_stopping_patience < 0:
            raise ValueError(f"early_stopping_patience must be an int >= 0, got {early_stopping_patience!r}")
        if isinstance(early_stopping_threshold, bool) or not isinstance(early_stopping_threshold, (int, float)) \
                or not early_stopping_threshold >= 0:
            raise ValueError(f"early_stopping_threshold must be a number >= 0, got {early_stopping_threshold!r}")
        check_watch(watch_metric, greater_is_better, reset_on_train)
        self.early_stopping_patience = early_stopping_patience
        self.early_stopping_threshold = early_stopping_threshold
        self.watch_metric = watch_metric
        self.greater_is_better = greater_is_better
        self.reset_on_train = reset_on_train
        self.early_stopping_patience_counter = 0
        self.best_metric = None
        self.stopped_epoch: int | None = None
        self.stopped_step: int | None = None
        self._new_values = NewValues(type(self).__name__)

    def decides_on(self) -> dict[str, Any]:
        """It decides at each epoch's end (on_training_run_epoch_end): the trainer stops there."""
        return {"epoch_checkpoint": None}

    def on_training_run_start(self, trainer, **kwargs):
        self.stopped_epoch = self.stopped_step = None
        if self.reset_on_train:
            self.best_metric = None
            self.early_stopping_patience_counter = 0

    def on_training_run_epoch_end(self, trainer, **kwargs):
        if self.stopped_epoch is not None:
            return  # it has asked to stop this run; epochs the halt arrives too late for change nothing
        current = self._new_values.take(trainer, self.watch_metric)
        if current is None:
            return
        if self.best_metric is None:
            self.best_metric = current
        else:
            is_improvement = better(current, self.best_metric, self.greater_is_better)
            improvement = abs(current - self.best_metric)
            if is_improvement and improvement > self.early_stopping_threshold:
                trainer.print(f"Improvement of {improvement} observed, resetting counter.")
                self.best_metric = current
                self.early_stopping_patience_counter = 0
            else:
                trainer.print("No improvement above threshold observed, incrementing counter.")
                self.early_stopping_patience_counter += 1
            trainer.print(f"Early stopping counter: {self.early_stopping_patience_counter}/"
                          f"{self.early_stopping_patience}")
        if self.early_stopping_patience_counter >= self.early_stopping_patience:
            self.stopped_epoch = trainer.run_history.current_epoch
            self.stopped_step = trainer.state.timestamp.batch
            raise StopTrainingError(
                f"Stopping training due to no improvement after {self.early_stopping_patience} epochs"
            )
