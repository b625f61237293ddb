"""`PrintProgressCallback`: a line at the start and end of a run and at the start of each epoch."""

from __future__ import annotations

from offloop.workers.callbacks.accelerated.adapter import TrainerCallback

__all__ = ["PrintProgressCallback"]


class PrintProgressCallback(TrainerCallback):
    """Prints a message at the start and end of a run, and at the start of each epoch
    (through the worker's logger)."""

    def on_training_run_start(self, trainer, **kwargs):
        trainer.print("Starting training run")

    def on_train_epoch_start(self, trainer, **kwargs):
        trainer.print(f"Starting epoch {trainer.run_history.current_epoch}")

    def on_eval_epoch_start(self, trainer, **kwargs):
        trainer.print("Starting eval epoch")

    def on_training_run_end(self, trainer, **kwargs):
        trainer.print("Finishing training run")

    def on_evaluation_run_start(self, trainer, **kwargs):
        trainer.print("Starting evaluation run")

    def on_evaluation_run_end(self, trainer, **kwargs):
        trainer.print("Finishing evaluation run")
