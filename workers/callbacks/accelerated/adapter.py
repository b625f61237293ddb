"""`TrainerCallback`: how a pytorch-accelerated callback runs in an offloop worker.

Promise: hooks fire in pytorch-accelerated's order with a read-only `trainer`, and a hook that
raises `StopTrainingError` gets `on_stop_training_error`, then halts the run through the
built-ins' one halt (`_halting`), as pytorch-accelerated's loop would stop.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from offloop.bus.control import Ack
from offloop.workers.callback import Callback
from offloop.workers.callbacks._halting import BackgroundHalt
from offloop.workers.callbacks.accelerated.run_history import RUN_HISTORY_TOPICS, RunHistory
from offloop.workers.callbacks.accelerated.trainer_view import TrainerView

__all__ = ["TrainerCallback", "OutOfProcessError", "HOOKS"]

log = logging.getLogger("offloop.worker")

#: offloop topic -> pytorch-accelerated hook, in pytorch-accelerated's order.
HOOKS: Mapping[str, str] = MappingProxyType({
    "init": "on_init_end",
    "fit_start": "on_training_run_start",
    "epoch_start": "on_train_epoch_start",
    "batch_start": "on_train_step_start",
    "batch_end": "on_train_step_end",
    "epoch_end": "on_train_epoch_end",
    "eval_start": "on_eval_epoch_start",
    "eval_batch_start": "on_eval_step_start",
    "eval_batch_end": "on_eval_step_end",
    "eval_end": "on_eval_epoch_end",
    "epoch_checkpoint": "on_training_run_epoch_end",
    "fit_end": "on_training_run_end",
    "eval_standalone_start": "on_evaluation_run_start",
    "eval_standalone_end": "on_evaluation_run_end",
})


class OutOfProcessError(RuntimeError):
    """A pytorch-accelerated callback that needs the trainer's own objects, which no worker has."""


class TrainerCallback(BackgroundHalt, Callback):
    """pytorch-accelerated's callback base class, run in an offloop worker.

    `run_event` folds each event into this callback's `RunHistory`, then calls the hook `HOOKS`
    names with a read-only `TrainerView` as `trainer`; `wanted_topics()` is the topics of the
    hooks a subclass overrides, plus those the run history is built from. Raise
    `StopTrainingError` from any hook to stop the run: `stop_training()` calls
    `on_stop_training_error` and `halt()`, which the trainer applies at its next batch boundary
    (`halt_ack` says where).
    From then on this callback gets no hook of the training run but `on_training_run_end`, as
    in pytorch-accelerated.
    """

    # set on the first event, not in __init__: subclasses need not call the base __init__
    _history: RunHistory | None = None
    _view: TrainerView | None = None

    # ----------------------------------------------------------------- dispatch

    def run_event(self, event, state, logger) -> None:
        topic = getattr(event, "value", event)
        view = self._trainer_view(state, logger)
        view.run_history.observe(topic, state)
        if topic == "fit_start":
            self._init_halt()  # one halt per training run
        if topic == "fit_end" and state.stopped_by and self.halt_ack is None:
            reason = state.stopped_by.get("reason", "") if isinstance(state.stopped_by, Mapping) else ""
            self.on_stop_training_error(view, reason=reason)  # another callback stopped the run
        hook = HOOKS.get(topic)
        if hook is None or not self._overrides(hook):
            return
        if self.halt_ack is not None and self.halt_ack.ok and topic != "fit_end":
            return
        getattr(self, hook)(view, **_hook_kwargs(topic, state))

    def _trainer_view(self, state, logger=None) -> TrainerView:
        """This callback's `trainer`, which on_stop_training_error gets too; a new one only
        when the worker hands over another State or Logger."""
        view = self._view
        if view is not None and view.state is state and (logger is None or logger is view.logger):
            return view
        if logger is None and view is not None:
            logger = view.logger
        if self._history is None:
            self._history = RunHistory()
        self._view = TrainerView(state, logger, self._history)
        return self._view

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_view", None)  # the worker's live State and Logger stay in the worker
        return state

    @classmethod
    def _overrides(cls, hook: str) -> bool:
        return getattr(cls, hook) is not getattr(TrainerCallback, hook)

    @classmethod
    def hook_topics(cls) -> frozenset[str]:
        """The topics whose hooks this class overrides."""
        return frozenset(topic for topic, hook in HOOKS.items() if cls._overrides(hook))

    @classmethod
    def wanted_topics(cls) -> frozenset[str] | None:
        if cls.run_event is not TrainerCallback.run_event:
            return None
        return cls.hook_topics() | RUN_HISTORY_TOPICS

    # ------------------------------------------------------------------- asking

    def stop_training(self, state, reason: str) -> None:
        """A hook raised StopTrainingError: `on_stop_training_error(trainer)` (a failure there
        is logged and the halt still goes), then `halt(reason)`, as pytorch-accelerated stops
        its loop."""
        try:
            self.on_stop_training_error(self._trainer_view(state))
        except Exception:
            log.exception("offloop: %s.on_stop_training_error failed", type(self).__name__)
        super().stop_training(state, reason)

    def halt(self, reason: str = "") -> Ack:
        """Ask the trainer to stop and wait for its answer (see `BackgroundHalt._halt_now`):
        once per training run, and answered at once, not ok, after the run's last batch."""
        if self._view is None:
            return super().halt(reason)  # before any event: asks, or says it is not attached
        return self._halt_now(self._view.state, reason)

    # -------------------------------------------------------------------- hooks

    def on_init_end(self, trainer, **kwargs):
        """Event called at the end of trainer initialisation (offloop: init)."""

    def on_training_run_start(self, trainer, **kwargs):
        """Event called at the start of training run (offloop: fit_start)."""

    def on_train_epoch_start(self, trainer, **kwargs):
        """Event called at the beginning of a training epoch (offloop: epoch_start)."""

    def on_train_step_start(self, trainer, **kwargs):
        """Event called at the beginning of a training step (offloop: batch_start)."""

    def on_train_step_end(self, trainer, batch, batch_output, **kwargs):
        """Event called at the end of a training step (offloop: batch_end).

        :param batch: (inputs, targets) of the batch's first samples when the trainer
            publishes them (`Trainer(publish_samples=n)`), else None
        :param batch_output: {'loss': the batch loss, 'batch_size': …} (+ 'model_outputs'
            of the published samples); kwargs carry `step`, the 0-based step in the epoch
        """

    def on_train_epoch_end(self, trainer, **kwargs):
        """Event called at the end of a training epoch (offloop: epoch_end)."""

    def on_eval_epoch_start(self, trainer, **kwargs):
        """Event called at the beginning of an evaluation epoch (offloop: eval_start)."""

    def on_eval_step_start(self, trainer, **kwargs):
        """Event called at the beginning of a evaluation step (offloop: eval_batch_start)."""

    def on_eval_step_end(self, trainer, batch, batch_output, **kwargs):
        """Event called at the end of an evaluation step (offloop: eval_batch_end).

        :param batch: (inputs, targets) when the trainer publishes eval outputs
            (`Trainer(publish_eval_outputs=True)`), else None
        :param batch_output: {'loss': the batch loss, or None while the trainer does not
            publish it} (+ 'model_outputs' when published)
        """

    def on_eval_epoch_end(self, trainer, **kwargs):
        """Event called at the end of evaluation (offloop: eval_end)."""

    def on_training_run_epoch_end(self, trainer, **kwargs):
        """Event called after both training and evaluation of an epoch (offloop: epoch_checkpoint)."""

    def on_training_run_end(self, trainer, **kwargs):
        """Event called at the end of training run (offloop: fit_end)."""

    def on_evaluation_run_start(self, trainer, **kwargs):
        """Event called at the start of an evaluation run (offloop: eval_standalone_start)."""

    def on_evaluation_run_end(self, trainer, **kwargs):
        """Event called at the end of an evaluation run (offloop: eval_standalone_end)."""

    def on_stop_training_error(self, trainer, **kwargs):
        """Event called when a stop training error is raised (by this callback: at once;
        when something else halted the run: at fit_end, before on_training_run_end)."""


def _hook_kwargs(topic: str, state) -> dict[str, Any]:
    if topic == "batch_end":
        samples = state.samples if isinstance(state.samples, Mapping) else {}
        output = {"loss": state.loss, "batch_size": state.batch_size}
        if samples.get("outputs") is not None:
            output["model_outputs"] = samples["outputs"]
        batch = (samples["inputs"], samples.get("targets")) if samples.get("inputs") is not None else None
        return {"batch": batch, "batch_output": output, "step": state.timestamp.batch_in_epoch - 1}
    if topic == "eval_batch_end":
        output = {"loss": state.data.get("loss")}
        if state.outputs is not None:
            output["model_outputs"] = state.outputs
        inputs = state.data.get("inputs")
        batch = (inputs, state.targets) if inputs is not None or state.targets is not None else None
        return {"batch": batch, "batch_output": output, "dataloader_label": state.dataloader_label}
    if topic in ("eval_start", "eval_end"):
        # a batch-interval evaluation inside an epoch is pytorch-accelerated's "intermediate" one
        return {"is_intermediate": state.timestamp.batch_in_epoch != 0,
                "dataloader_label": state.dataloader_label}
    if topic == "eval_batch_start":
        return {"dataloader_label": state.dataloader_label}
    return {}
