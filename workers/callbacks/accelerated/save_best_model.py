"""`SaveBestModelCallback`: on each improvement of a run-history metric, a checkpoint at `save_path`.

Promise: `save_path` changes in one rename, and only to a checkpoint the trainer acknowledged.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from offloop.workers.callbacks._halting import past_last_batch
from offloop.workers.callbacks.accelerated._watch import NewValues, better, check_watch
from offloop.workers.callbacks.accelerated.adapter import TrainerCallback

__all__ = ["SaveBestModelCallback"]


class SaveBestModelCallback(TrainerCallback):
    """Keeps the best model of a training run by `watch_metric`.

    At the end of each epoch (`on_training_run_epoch_end`, after the epoch's evaluation, as
    pytorch-accelerated does), on an improvement (the first value counts as one) it asks the
    trainer for a checkpoint tagged 'best' and links (or copies) the file the ack names to
    `save_path`, worker-side (a relative `save_path` is relative to the worker's working
    directory). It records `best_metric`, `best_metric_epoch`, `best_metric_step` (the step
    evaluated), and for the file in `save_path`: `best_checkpoint` (the trainer's file),
    `best_checkpoint_step` (the step it holds: the trainer's first batch boundary after the
    request, so at least one batch after the evaluation) and `saved_metric`.

    It cannot load the best weights back at the end as pytorch-accelerated does: the model
    lives in the trainer's process, and a worker can only ask for halts and checkpoints. Resume
    from the best with `Trainer(load_path=save_path)`. An improvement at the run's final
    evaluation comes after the trainer's last batch boundary, where no checkpoint can be taken
    any more; it is recorded in `best_metric` and reported, and `save_path` keeps the previous best.
    """

    def __init__(self, save_path: str | os.PathLike = "best_model.pt", watch_metric: str = "eval_loss_epoch",
                 greater_is_better: bool = False, reset_on_train: bool = True) -> None:
        if not isinstance(save_path, (str, os.PathLike)) or not str(save_path):
            raise ValueError(f"save_path must be a file path, got {save_path!r}")
        check_watch(watch_metric, greater_is_better, reset_on_train)
        self.save_path = save_path
        self.watch_metric = watch_metric
        self.greater_is_better = greater_is_better
        self.reset_on_train = reset_on_train
        self.best_metric = None
        self.best_metric_epoch: int | None = None
        self.best_metric_step: int | None = None
        self.best_checkpoint: str | None = None
        self.best_checkpoint_step: int | None = None
        self.saved_metric = None
        self._new_values = NewValues(type(self).__name__)

    def decides_on(self) -> dict[str, Any]:
        """It saves at each epoch's end (on_training_run_epoch_end): the checkpoint holds that
        epoch's weights, the run's last one included."""
        return {"epoch_checkpoint": None}

    def on_training_run_start(self, trainer, **kwargs):
        if self.reset_on_train:
            self.best_metric = self.best_metric_epoch = self.best_metric_step = None

    def on_training_run_epoch_end(self, trainer, **kwargs):
        current = self._new_values.take(trainer, self.watch_metric)
        if current is None:
            return
        if self.best_metric is not None and not better(current, self.best_metric, self.greater_is_better):
            return
        self.best_metric = current
        self.best_metric_epoch = trainer.run_history.current_epoch
        self.best_metric_step = trainer.state.timestamp.batch
        self._save(trainer, current)

    def _save(self, trainer, metric: Any) -> None:
        # awaited (the trainer waits at this epoch's end) it saves now, after the last batch too
        if past_last_batch(trainer.state) is not None and not trainer.state.decision_awaited:
            trainer.print(f"SaveBestModelCallback: {self.watch_metric}={metric} improved at the run's "
                          "final evaluation, after the trainer's last batch: no checkpoint can be taken "
                          f"now; {self.save_path} keeps {self.watch_metric}={self.saved_metric}")
            return
        ack = self.request_checkpoint("best")
        if not ack.ok:
            trainer.print(f"SaveBestModelCallback: the trainer refused a checkpoint: {ack.error}")
            return
        source = Path(ack.result["path"])
        try:
            _link_or_copy(source, Path(self.save_path))
        except OSError as exc:
            trainer.print(f"SaveBestModelCallback: could not put {source} at {self.save_path} "
                          f"({exc.strerror or exc}); the checkpoint stays where the trainer wrote it")
            return
        self.best_checkpoint, self.best_checkpoint_step = str(source), ack.result.get("step")
        self.saved_metric = metric

    def on_training_run_end(self, trainer, **kwargs):
        if self.saved_metric is not None:
            trainer.print(
                f"Best checkpoint: {self.watch_metric}={self.saved_metric} (weights of step "
                f"{self.best_checkpoint_step}) is at {self.save_path}. The trainer keeps its final "
                "weights (a worker cannot load weights into it): resume from the best with "
                f"Trainer(load_path={str(self.save_path)!r})"
            )


def _link_or_copy(source: Path, target: Path) -> None:
    """Put `source` at `target` in one rename: a hard link when both are on one file system
    (the trainer writes checkpoints by rename, so the link keeps this version), else a copy."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(source, tmp)
    except OSError:
        shutil.copyfile(source, tmp)
    os.replace(tmp, target)
