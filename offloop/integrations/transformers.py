"""Hugging Face's Trainer publishes to offloop: `Trainer(callbacks=[OffloopCallback(...)])`.

Each of transformers' `TrainerCallback` hooks fires the Composer events it stands for;
offloop's callbacks run in worker processes as with offloop's own Trainer. A halt sets
`control.should_training_stop` at the step it is read at (every rank agrees on it); a
checkpoint request sets `control.should_save`, so that Hugging Face's Trainer writes its
own `checkpoint-<step>` folder in `args.output_dir` at that step, and is acknowledged
with that folder once it exists (refused if the Trainer did not write it).

docs/integrations.md has the table of which events each hook fires, and the events
Hugging Face has no place for: after_forward, before_loss, after_loss and before_backward
happen inside `Trainer.training_step`, which calls back no one.

The loss: Hugging Face hands callbacks no loss tensor; it reads the loss only where it
logs (every `logging_steps`). At a logging step batch_end waits for `on_log`, which HF
calls right after `on_step_end` (before its evaluation and its save, so a halt or a
checkpoint still lands at that step), and carries the loss HF logged: the mean over the
steps since its last log (the step's own loss with `logging_steps=1`), with HF's other
logged numbers (`grad_norm`, `learning_rate`, `epoch`, ...) as train metrics
(`state.train_metrics`). Between logging steps batch_end's loss is None.
after_train_batch carries no loss, and grad_norms is not published. batch_end's batch
size is the nominal `per_device_train_batch_size * gradient_accumulation_steps` (HF
does not say how many samples a short last batch held).

One `train()` per callback: the run closes at its end. HF has no exception hook: a run
that raises is closed at exit (atexit) without fit_end.
"""

from __future__ import annotations

import logging
import numbers
import os
from typing import Any

from offloop.bus import Topic
from offloop.trainer.hooked_run import HookedRun, check_callbacks
from offloop.workers.destinations import MissingExtraError

try:
    import transformers
    from transformers import TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError:
    raise MissingExtraError("offloop.integrations.transformers needs transformers, which is not installed: "
                            "pip install 'offloop[transformers]'") from None

__all__ = ["OffloopCallback"]

log = logging.getLogger("offloop.integrations")

EVAL_LABEL = "eval"  # each of HF's evaluations, under the label offloop's Trainer gives its eval


class OffloopCallback(TrainerCallback):
    """Publishes a Hugging Face Trainer's events and runs offloop `callbacks` out of process.

    Args are offloop Trainer's: `callbacks` and `loggers` (offloop's), `run_name`,
    `run_dir`, `save_folder` (unused for requested checkpoints: Hugging Face writes them
    in `args.output_dir`), `host`, `keys`, `insecure`, `heartbeat_interval`,
    `burst_interval`, `worker_shutdown_timeout`, `worker_nice`, `decision_timeout`, `hparams`.
    """

    def __init__(self, callbacks: list | None = None, *, loggers: list | None = None,
                 run_name: str | None = None, run_dir: str | os.PathLike | None = None,
                 save_folder: str | os.PathLike | None = None, **settings: Any) -> None:
        super().__init__()
        self.run = HookedRun(check_callbacks(callbacks), loggers=loggers, run_name=run_name, run_dir=run_dir,
                             save_folder=save_folder, **settings)
        self._size = 0  # batch_end's batch size: samples per optimizer step on this rank
        self._micro = 0  # the microbatch training now
        self._pending = False  # the step ended at a logging step: batch_end waits for on_log
        self._optimizer_stepped = False  # on_pre_optimizer_step came this step (transformers >= 4.47)
        self._evaluating = False  # eval_before_all and eval_start went out for this evaluation
        self._epoch_checkpoint = False  # epoch_checkpoint waits for the epoch's evaluation
        self._saving = False  # control.should_save was set for requested checkpoints
        self._requests: list = []  # their requests (none on ranks other than 0)
        self._where = ""  # the event they were agreed at

    @property
    def _live(self) -> bool:
        return self.run.started and not self.run.closed

    # ------------------------------------------------------------------ fit

    def on_train_begin(self, args, state, control, model=None, optimizer=None, train_dataloader=None,
                       **kwargs: Any) -> None:
        """The optimizer exists and a resumed checkpoint is loaded: the run starts (run.json,
        workers, init, before_load), then after_load and fit_start."""
        run = self.run
        if run.started:
            return
        accum = args.gradient_accumulation_steps
        self._size = args.per_device_train_batch_size * accum
        device = getattr(model, "device", None)
        if device is None:
            device = next(model.parameters()).device
        optimizers = [getattr(optimizer, "optimizer", optimizer)] if optimizer is not None else []
        run.start(model, optimizers, device, None, max_duration=f"{state.max_steps}ba", seed=args.seed,
                  precision="amp_bf16" if args.bf16 else "amp_fp16" if args.fp16 else "fp32", grad_accum=accum,
                  extra_config={"host_trainer": f"transformers {transformers.__version__}",
                                "dataloader_len": _steps_per_epoch(train_dataloader, accum)})
        run.set_timestamp(int(state.epoch or 0), state.global_step)
        run.emit(Topic.AFTER_LOAD, {"path": _resumed_from(args, state)})
        run.fit_start()

    def on_epoch_begin(self, args, state, control, **kwargs: Any) -> None:
        if not self._live:
            return
        self._settle(state)
        self._flush_epoch_checkpoint(control)
        self.run.epoch_start()
        self.run.emit(Topic.BEFORE_DATALOADER)

    def on_step_begin(self, args, state, control, **kwargs: Any) -> None:
        if not self._live:
            return
        self._settle(state)
        self._step_end(control)  # a logging step whose log never came: its batch_end now
        run = self.run
        self._micro, self._optimizer_stepped = 0, False
        run.emit(Topic.AFTER_DATALOADER)
        run.emit(Topic.BATCH_START, {"batch_size": self._size})
        run.emit(Topic.BEFORE_TRAIN_BATCH, {"batch_size": self._size, "microbatches": args.gradient_accumulation_steps})
        run.emit(Topic.BEFORE_FORWARD, {"microbatch": 0})

    def on_substep_end(self, args, state, control, **kwargs: Any) -> None:
        """A microbatch's backward is done; the next one's forward comes."""
        if not self._live:
            return
        run = self.run
        run.emit(Topic.AFTER_BACKWARD, {"microbatch": self._micro})
        self._micro += 1
        run.emit(Topic.BEFORE_FORWARD, {"microbatch": self._micro})

    def on_pre_optimizer_step(self, args, state, control, **kwargs: Any) -> None:
        if self._live:
            self._optimizer_stepped = True
            self._after_train_batch()

    def on_step_end(self, args, state, control, **kwargs: Any) -> None:
        """The optimizer has stepped. At a logging step (DefaultFlowCallback, called before
        this one, has set `control.should_log`) batch_end waits for on_log and its loss."""
        if not self._live:
            return
        if not self._optimizer_stepped:  # a transformers without on_pre_optimizer_step
            self._after_train_batch()
        self._pending = True
        if not control.should_log:
            self._step_end(control)

    def on_log(self, args, state, control, logs=None, **kwargs: Any) -> None:
        """HF's log of the step that just ended: batch_end with the loss HF logged."""
        if not self._live or not self._pending:
            return  # an evaluation's log (its metrics come with on_evaluate), or the fit's summary
        logs = logs or {}
        loss = logs.get("loss")
        if not _number(loss):  # not the step's log (a callback after this one unset should_log)
            self._step_end(control)
            return
        metrics = {name: float(value) for name, value in logs.items() if name != "loss" and _number(value)}
        if metrics:  # they travel with this batch_end, as log_metrics() values do
            self.run.log_metrics(metrics)
        self._step_end(control, float(loss))

    def on_epoch_end(self, args, state, control, **kwargs: Any) -> None:
        """epoch_end; epoch_checkpoint now, or after the epoch's evaluation when HF evaluates
        at the epoch's end (DefaultFlowCallback has set `control.should_evaluate`)."""
        if not self._live:
            return
        self._settle(state)
        self._step_end(control)
        run = self.run
        if run.epoch_end():
            control.should_training_stop = True
        self._take_requests(control, Topic.EPOCH_END)
        self._epoch_checkpoint = True
        if not control.should_evaluate:
            self._flush_epoch_checkpoint(control)

    def on_train_end(self, args, state, control, **kwargs: Any) -> None:
        if not self._live:
            return
        self._step_end(control)
        self._flush_epoch_checkpoint(control)
        self._settle(state)
        self.run.fit_end()
        self.run.close()

    # ----------------------------------------------------------- evaluation

    def on_prediction_step(self, args, state, control, **kwargs: Any) -> None:
        if not self._live:
            return
        self._step_end(control)
        run = self.run
        self._eval_start()
        data = {"dataloader_label": EVAL_LABEL}
        run.emit(Topic.EVAL_BATCH_START, data)
        run.emit(Topic.EVAL_BEFORE_FORWARD, data)
        run.emit(Topic.EVAL_AFTER_FORWARD, data)
        run.emit(Topic.EVAL_BATCH_END, data)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs: Any) -> None:
        """eval_end with HF's metrics: an EarlyStopper decides here. HF saves after this
        hook, so a checkpoint requested meanwhile is still written at this step."""
        if not self._live:
            return
        self._step_end(control)
        self._eval_start()
        self._evaluating = False
        values = {name: float(value) for name, value in (metrics or {}).items() if _number(value)}
        if self.run.eval_end(EVAL_LABEL, values):
            control.should_training_stop = True
        self._take_requests(control, Topic.EVAL_END)
        self._flush_epoch_checkpoint(control)

    # ------------------------------------------------------------ checkpoints

    def on_save(self, args, state, control, **kwargs: Any) -> None:
        """HF has written `checkpoint-<step>`: the requests it was asked for are answered."""
        if not self._live or not self._saving:
            return
        requests, where = self._requests, self._where
        self._saving, self._requests, self._where = False, [], ""
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if os.path.isdir(folder):
            self.run.saved(requests, folder, where)
        else:
            _refuse(requests, f"Hugging Face's Trainer wrote no {folder}", state.global_step)

    # --------------------------------------------------------------- helpers

    def _after_train_batch(self) -> None:
        run = self.run
        run.emit(Topic.AFTER_BACKWARD, {"microbatch": self._micro})
        run.emit(Topic.AFTER_TRAIN_BATCH, {"loss": None})

    def _step_end(self, control, loss: float | None = None) -> None:
        """batch_end (where it waited for on_log), the control poll, batch_checkpoint."""
        if not self._pending:
            return
        self._pending = False
        run = self.run
        if run.batch_end(loss, self._size):
            control.should_training_stop = True  # every rank agreed on this step
        self._take_requests(control, Topic.BATCH_CHECKPOINT)
        run.emit(Topic.BEFORE_DATALOADER)

    def _take_requests(self, control, where: str) -> None:
        """Checkpoints agreed at `where`: HF saves this step (`should_save`), on every rank."""
        run = self.run
        due, requests = run.due_requests()
        if due:
            control.should_save = True
            self._saving = True
            self._requests += requests
            self._where = self._where or where

    def _settle(self, state) -> None:
        """Requests HF was asked to save for and did not (a callback unset should_save, or
        save_strategy='best' overruled it): refused, training goes on."""
        if self._saving:
            requests = self._requests
            self._saving, self._requests, self._where = False, [], ""
            _refuse(requests, f"Hugging Face's Trainer did not save at step {state.global_step}",
                    state.global_step)

    def _eval_start(self) -> None:
        if not self._evaluating:
            self._evaluating = True
            self.run.emit(Topic.EVAL_BEFORE_ALL)
            self.run.emit(Topic.EVAL_START, {"dataloader_label": EVAL_LABEL})

    def _flush_epoch_checkpoint(self, control) -> None:
        if self._epoch_checkpoint:
            self._epoch_checkpoint = False
            if self.run.epoch_checkpoint():
                control.should_training_stop = True
            self._take_requests(control, Topic.EPOCH_CHECKPOINT)


def _refuse(requests: list, message: str, step: int) -> None:
    for request in requests:
        request.refuse(message, step=step)
    if requests:
        log.warning("offloop: %s; training goes on", message)


def _number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _steps_per_epoch(train_dataloader: Any, accum: int) -> int | None:
    """Optimizer steps per epoch on this rank (HF's num_update_steps_per_epoch)."""
    try:
        return -(-len(train_dataloader) // accum)
    except TypeError:  # no dataloader, or an iterable one
        return None


def _resumed_from(args, state) -> str | None:
    """The checkpoint HF resumed from: HF hands callbacks no path; `args.resume_from_checkpoint`
    when set, else `checkpoint-<step>` in output_dir where that exists (train(resume_from_checkpoint=True))."""
    if not state.global_step:
        return None
    if isinstance(args.resume_from_checkpoint, str) and args.resume_from_checkpoint:
        return args.resume_from_checkpoint
    folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
    return folder if os.path.isdir(folder) else None
