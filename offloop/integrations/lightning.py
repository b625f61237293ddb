"""PyTorch Lightning publishes to offloop: `L.Trainer(callbacks=[OffloopCallback(...)])`.

Each Lightning hook fires the Composer events it stands for (docs/integrations.md has
the table, and the events Lightning has no place for); offloop's callbacks run in
worker processes as with offloop's own Trainer. A halt sets `trainer.should_stop` at the
same batch on every rank; a checkpoint request calls `trainer.save_checkpoint` on every
rank and is acknowledged with the file's path.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from offloop.bus import Topic
from offloop.trainer.batches import batch_size
from offloop.trainer.hooked_run import HookedRun, check_callbacks
from offloop.workers.destinations import MissingExtraError

try:
    import lightning.pytorch as pl
except ImportError:  # the older package name ships the same Callback
    try:
        import pytorch_lightning as pl
    except ImportError:
        raise MissingExtraError("offloop.integrations.lightning needs lightning, which is not installed: "
                                "pip install 'offloop[lightning]'") from None

__all__ = ["OffloopCallback"]

EVAL_LABEL = "eval"  # Lightning's validation loop, under the label offloop's Trainer gives its eval
_MICROBATCH = {"microbatch": 0}  # one microbatch a step; events hold their data unchanged, so shared


class OffloopCallback(pl.Callback):
    """Publishes a Lightning run's events and runs offloop `callbacks` out of process.

    Args are offloop Trainer's: `callbacks` and `loggers` (offloop's), `run_name`,
    `run_dir`, `save_folder` (where requested checkpoints go; default the run directory's
    `checkpoints/`), `host`, `keys`, `insecure`, `heartbeat_interval`, `burst_interval`,
    `worker_shutdown_timeout`, `worker_nice`, `decision_timeout`, `hparams`.
    """

    def __init__(self, callbacks: list | None = None, *, loggers: list | None = None,
                 run_name: str | None = None, run_dir: str | os.PathLike | None = None,
                 save_folder: str | os.PathLike | None = None, **settings: Any) -> None:
        super().__init__()
        self.run = HookedRun(check_callbacks(callbacks), loggers=loggers, run_name=run_name, run_dir=run_dir,
                             save_folder=save_folder, checkpoint_suffix=".ckpt", **settings)
        self._size = 0
        self._loss: Any = None  # the step's loss as published (staged once on CUDA)
        self._epoch_ended = False  # epoch_end fired before the epoch's validation

    # ------------------------------------------------------------------ fit

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The optimizers exist from here: the run starts (run.json, workers, init)."""
        run = self.run
        seed = os.environ.get("PL_GLOBAL_SEED")
        run.start(pl_module, trainer.optimizers, pl_module.device, lambda path: _save(trainer, path),
                  max_duration=_max_duration(trainer), train_dataloader=None,
                  seed=int(seed) if seed and seed.lstrip("-").isdigit() else None,
                  precision=str(trainer.precision), grad_accum=trainer.accumulate_grad_batches,
                  extra_config={"host_trainer": f"lightning {pl.__version__}",
                                "dataloader_len": _len(trainer.num_training_batches)})

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Lightning has restored a checkpoint's counters by now: after_load, fit_start."""
        run = self.run
        run.set_timestamp(trainer.current_epoch, trainer.global_step)
        run.emit(Topic.AFTER_LOAD, {"path": str(trainer.ckpt_path) if trainer.ckpt_path else None})
        run.fit_start()

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.run.epoch_start()
        self.run.emit(Topic.BEFORE_DATALOADER)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        run = self.run
        self._size, self._loss = batch_size(batch), None
        run.emit(Topic.AFTER_DATALOADER)
        run.emit(Topic.BATCH_START, {"batch_size": self._size})
        run.emit(Topic.BEFORE_TRAIN_BATCH, {"batch_size": self._size, "microbatches": 1})
        run.emit(Topic.BEFORE_FORWARD, _MICROBATCH)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        run = self.run
        if run.wants(Topic.AFTER_LOSS) or run.wants(Topic.AFTER_TRAIN_BATCH) or run.wants(Topic.BATCH_END):
            self._loss = run.host_value(loss)
            run.snapshot(Topic.AFTER_LOSS, {"microbatch": 0, "loss": self._loss})
        run.emit(Topic.BEFORE_BACKWARD, _MICROBATCH)

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.run.emit(Topic.AFTER_BACKWARD, _MICROBATCH)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.run.snapshot(Topic.AFTER_TRAIN_BATCH, {"loss": self._loss})

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        run = self.run
        loss = self._loss
        if loss is None and run.wants(Topic.BATCH_END):  # no backward seen (manual optimization)
            value = outputs.get("loss") if isinstance(outputs, dict) else outputs
            loss = run.host_value(value) if hasattr(value, "detach") else None
        if run.batch_end(loss, self._size, batch=batch):
            trainer.should_stop = True  # every rank agreed on this batch
        run.emit(Topic.BEFORE_DATALOADER)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Lightning validates before this hook; Composer after epoch_end: the epoch ended
        when its validation started, if it had one (on_validation_start)."""
        if not self._epoch_ended and self.run.epoch_end():
            trainer.should_stop = True
        self._epoch_ended = False
        if self.run.epoch_checkpoint():
            trainer.should_stop = True

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.run.fit_end()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.run.fit_end()
            self.run.close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.run.fit_end()  # the workers see the run end; run.json says finished
        self.run.close(wait_for_workers=False)

    # ----------------------------------------------------------- validation

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        if trainer.state.fn == "fit" and trainer.is_last_batch and not self._epoch_ended:
            self._epoch_ended = True  # the epoch's end, in Composer's order: before its eval
            if self.run.epoch_end():
                trainer.should_stop = True
        self.run.emit(Topic.EVAL_BEFORE_ALL)
        self.run.emit(Topic.EVAL_START, {"dataloader_label": EVAL_LABEL})

    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                                  batch_idx: int, dataloader_idx: int = 0) -> None:
        if not trainer.sanity_checking:
            self.run.emit(Topic.EVAL_BATCH_START, {"dataloader_label": EVAL_LABEL})
            self.run.emit(Topic.EVAL_BEFORE_FORWARD, {"dataloader_label": EVAL_LABEL})

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                                batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        if not trainer.sanity_checking:
            run = self.run
            run.emit(Topic.EVAL_AFTER_FORWARD, {"dataloader_label": EVAL_LABEL})
            if run.wants(Topic.EVAL_BATCH_END):
                value = outputs.get("loss") if isinstance(outputs, dict) else outputs
                data = {"dataloader_label": EVAL_LABEL}
                if hasattr(value, "detach") and getattr(value, "ndim", 1) == 0:
                    data["loss"] = run.host_value(value)
                run.snapshot(Topic.EVAL_BATCH_END, data)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """eval_end with what the module logged (`self.log`): an EarlyStopper decides here."""
        if trainer.sanity_checking:
            return
        run = self.run
        metrics = {name: run.host_value(value) if hasattr(value, "detach") else value
                   for name, value in trainer.callback_metrics.items()}
        if run.eval_end(EVAL_LABEL, metrics):
            trainer.should_stop = True


def _save(trainer: pl.Trainer, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    trainer.save_checkpoint(path)  # every rank calls it; Lightning's strategy writes on rank 0
    return path


def _max_duration(trainer: pl.Trainer) -> str | None:
    if trainer.max_steps is not None and trainer.max_steps > 0:
        return f"{trainer.max_steps}ba"
    return f"{trainer.max_epochs}ep" if trainer.max_epochs is not None and trainer.max_epochs > 0 else None


def _len(value: Any) -> int | None:
    try:
        return int(value) if value != float("inf") else None
    except (TypeError, ValueError):
        return None
