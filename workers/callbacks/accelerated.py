"""pytorch-accelerated's callbacks in an offloop worker: `TrainerCallback` maps offloop's events
onto its hooks, and the built-ins keep its names, options and semantics.

Promise: hooks fire in pytorch-accelerated's order with a read-only `trainer` view, and a hook
that raises `StopTrainingError` halts the run (the worker runtime asks the trainer).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, TextIO

from offloop.bus import Event
from offloop.bus.control import Ack
from offloop.workers.callback import Callback
from offloop.workers.runtime import StopTrainingError

__all__ = [
    "TrainerCallback",
    "StopTrainingError",
    "RunHistory",
    "RunConfig",
    "TrainerView",
    "TerminateOnNaNCallback",
    "LogMetricsCallback",
    "PrintProgressCallback",
    "ProgressBarCallback",
    "SaveBestModelCallback",
    "EarlyStoppingCallback",
    "MoveModulesToDeviceCallback",
    "OutOfProcessError",
    "HOOKS",
    "RUN_HISTORY_TOPICS",
]

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

#: What the run history is built from. The worker subscribes to all of them in any case
#: (they keep its State current), so wanting them costs nothing on the wire.
RUN_HISTORY_TOPICS = frozenset({"fit_start", "batch_end", "eval_end", "fit_end"})

_EPOCH_OF_NEXT_BATCH = frozenset({"init", "fit_start", "epoch_start", "batch_start", "batch_end"})


class OutOfProcessError(RuntimeError):
    """A pytorch-accelerated callback that needs the trainer's own objects, which no worker has."""


# ------------------------------------------------------------------ what `trainer` offers


class RunHistory:
    """pytorch-accelerated's RunHistory, kept by the worker from the events it receives.

    'train_loss_epoch' is the sample-weighted mean of the epoch's batch losses (as
    pytorch-accelerated's LossTracker computes it); 'eval_loss_epoch' is eval_end's metric
    'loss'; every other eval metric is kept under its own name. With several eval
    dataloaders, those of a label other than 'eval' are named '<label>_loss_epoch' and
    '<label>_<metric>'. `update_metric` adds to this worker's history only.
    """

    def __init__(self) -> None:
        self._metrics: dict[str, list] = {}
        self._current_epoch = 1
        self.generation = 0  # bumped by reset(): tells a new training run's values apart

    def get_metric_names(self) -> set[str]:
        return set(self._metrics)

    def get_metric_values(self, metric_name: str) -> list:
        return list(self._metrics.get(metric_name, ()))

    get_metric = get_metric_values  # the older pytorch-accelerated name

    def get_latest_metric(self, metric_name: str) -> Any:
        values = self._metrics.get(metric_name)
        return values[-1] if values else None

    def update_metric(self, metric_name: str, metric_value: Any) -> None:
        self._metrics.setdefault(metric_name, []).append(metric_value)

    @property
    def current_epoch(self) -> int:
        """1-based, as in pytorch-accelerated: the epoch being trained, or just trained and
        being evaluated."""
        return self._current_epoch

    def reset(self) -> None:
        self._metrics = {}
        self._current_epoch = 1
        self.generation += 1


_PRECISION = {"fp32": "no", "amp_fp16": "fp16", "amp_bf16": "bf16"}


class RunConfig(Mapping):
    """pytorch-accelerated's TrainerRunConfig, read from the run's published config: by
    attribute (`run_config.num_epochs`) or by key (`run_config["num_epochs"]`). Keys of
    offloop's own config (run_name, seed, precision, …) are there too. Unknown to a worker,
    and so None: gradient_clip_value and the eval batch sizes."""

    def __init__(self, state) -> None:
        config = dict(state.config)
        world = int(config.get("world_size") or 1)
        steps = state.dataloader_len
        batch_size = state.batch_size
        duration = state.max_duration
        unit = getattr(getattr(duration, "unit", None), "value", None)
        num_epochs = None
        if unit == "ep":
            num_epochs = duration.value
        elif unit == "ba" and steps:
            num_epochs = math.ceil(duration.value / steps)
        values = {**config, **{
            "num_epochs": num_epochs,
            "max_num_train_steps": duration.value if unit == "ba" else None,
            "train_per_device_batch_size": batch_size,
            "train_total_batch_size": batch_size * world if batch_size else None,
            "eval_per_device_batch_size": None,
            "eval_total_batch_size": None,
            "train_dl_kwargs": {},
            "eval_dl_kwargs": {},
            "gradient_accumulation_steps": config.get("grad_accum", 1),
            "gradient_clip_value": None,
            "num_update_steps_per_epoch": steps,
            "num_local_update_steps_per_epoch": steps,
            "is_local_process_zero": state.rank == 0,
            "is_world_process_zero": state.rank == 0,
            "is_distributed": world > 1,
            "mixed_precision": _PRECISION.get(config.get("precision"), config.get("precision")),
            "num_processes": world,
        }}
        object.__setattr__(self, "_values", MappingProxyType(values))

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"run_config has no {name!r}; it has {', '.join(sorted(self._values))}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("run_config is read-only: it describes the trainer's run")

    def to_dict(self) -> dict[str, Any]:
        return dict(self._values)


class TrainerView:
    """The `trainer` a pytorch-accelerated hook receives in a worker: `state` (the offloop
    State), `run_history`, `run_config`, `logger` (the worker's Logger), `device` (the CPU:
    published tensors arrive on the host) and `print()`. The trainer itself is in another
    process; anything else raises AttributeError saying so."""

    def __init__(self, state, logger=None) -> None:
        object.__setattr__(self, "_state", weakref.ref(state))  # the registry is keyed weakly by it
        object.__setattr__(self, "logger", logger)
        object.__setattr__(self, "run_history", RunHistory())
        object.__setattr__(self, "_history", _HistoryKeeper(self.run_history))

    @property
    def state(self):
        return self._state()

    @property
    def run_config(self) -> RunConfig:
        return RunConfig(self.state)

    @property
    def device(self):
        import torch

        return torch.device("cpu")

    def print(self, *args: Any, sep: str = " ", **_: Any) -> None:
        """Print once, as pytorch-accelerated's `trainer.print` does: through the worker's logger."""
        text = sep.join(str(a) for a in args).strip("\n")
        if self.logger is not None:
            self.logger.log_text(text)
        else:
            print(text, flush=True)

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"trainer.{name} is not available to a callback in an offloop worker: the trainer "
            "runs in another process and publishes read-only snapshots. Read trainer.state, "
            "trainer.run_history or trainer.run_config; to change the run, raise StopTrainingError "
            "or call self.halt() / self.request_checkpoint()"
        )

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"cannot set trainer.{name}: a worker observes the run (the trainer is in another "
            "process); ask it with self.halt() or self.request_checkpoint()"
        )


class _HistoryKeeper:
    """Folds each event into a RunHistory once, however many callbacks of the worker see it."""

    def __init__(self, history: RunHistory) -> None:
        self.history = history
        self._last_data: Any = None
        self._loss_sum = 0.0
        self._loss_count = 0
        self._loss_epoch: int | None = None

    def observe(self, topic: str, state) -> None:
        if state.data is self._last_data:  # holding the last one keeps identity unambiguous
            return
        self._last_data = state.data
        ts = state.timestamp
        if topic == "fit_start":
            self.history.reset()
            self._loss_sum, self._loss_count, self._loss_epoch = 0.0, 0, None
        if self._loss_epoch is not None and ts.epoch > self._loss_epoch:
            self._close_train_epoch()
        if topic in _EPOCH_OF_NEXT_BATCH:
            self.history._current_epoch = ts.epoch + 1
        elif topic == "epoch_end":
            self.history._current_epoch = ts.epoch  # the counter has moved on; the epoch has not
        if topic == "batch_end" and state.loss is not None:
            weight = state.batch_size or 1
            self._loss_sum += _number(state.loss) * weight
            self._loss_count += weight
            self._loss_epoch = ts.epoch
        elif topic == "eval_end":
            self._fold_eval(state)

    def _close_train_epoch(self) -> None:
        self.history.update_metric("train_loss_epoch", self._loss_sum / max(self._loss_count, 1))
        self._loss_sum, self._loss_count, self._loss_epoch = 0.0, 0, None

    def _fold_eval(self, state) -> None:
        label = state.dataloader_label or "eval"
        labels = state.config.get("eval_dataloaders") or {}
        plain = label == "eval" or len(labels) <= 1
        for name, value in (state.eval_metrics.get(label) or {}).items():
            if name == "loss":
                key = "eval_loss_epoch" if plain else f"{label}_loss_epoch"
            else:
                key = name if plain else f"{label}_{name}"
            self.history.update_metric(key, value)


def _number(value: Any) -> float:
    if hasattr(value, "item"):
        return float(value.detach().float().mean().item()) if value.numel() != 1 else float(value.item())
    return float(value)


_VIEWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _view_for(state, logger=None) -> TrainerView:
    """One view (and run history) per worker State: callbacks of one worker share it, as
    pytorch-accelerated's callbacks share their trainer's run history."""
    view = _VIEWS.get(state)
    if view is None:
        view = _VIEWS[state] = TrainerView(state, logger)
    elif logger is not None and view.logger is not logger:
        object.__setattr__(view, "logger", logger)
    return view


def _run_is_over(state) -> bool:
    """No batch boundary is left at which the trainer could apply a request."""
    if state.event is Event.FIT_END:
        return True
    duration = state.max_duration
    return duration is not None and duration.reached(state.timestamp)


# --------------------------------------------------------------------------- the base


class TrainerCallback(Callback):
    """pytorch-accelerated's callback base class, run in an offloop worker.

    `run_event` calls the hook `HOOKS` names for each event, with a read-only `TrainerView`
    as `trainer`; `wanted_topics()` is the topics of the hooks a subclass overrides, plus
    the few the run history is built from. Raise `StopTrainingError` from any hook to stop
    the run: the worker calls `on_stop_training_error` and asks the trainer to halt, which
    it does at its next batch boundary. From then on this callback gets no hook of the
    training run but `on_training_run_end`, as in pytorch-accelerated.
    """

    #: The trainer's answer to this callback's halt in the current training run.
    halt_ack: Ack | None = None

    # ----------------------------------------------------------------- dispatch

    def run_event(self, event, state, logger) -> None:
        topic = getattr(event, "value", event)
        self._offloop_state = state
        view = _view_for(state, logger)
        view._history.observe(topic, state)
        if topic == "fit_start":
            self.halt_ack = None
        if topic == "fit_end" and state.stopped_by and self.halt_ack is None:
            reason = state.stopped_by.get("reason", "") if isinstance(state.stopped_by, Mapping) else ""
            self.on_stop_training_error(view, reason=reason)  # another callback stopped the run
        hook = HOOKS.get(topic)
        if hook is None or not self._overrides(hook):
            return
        if self.halt_ack is not None and self.halt_ack.ok and topic != "fit_end":
            return
        getattr(self, hook)(view, **_hook_kwargs(topic, state))

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_offloop_state", None)  # the worker's live State stays in the worker
        return state

    def _trainer_view(self, state) -> TrainerView:
        """The `trainer` the worker runtime passes to on_stop_training_error."""
        return _view_for(state)

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

    def halt(self, reason: str = "") -> Ack:
        """Ask the trainer to stop; the ack says at which step it did. A second halt in the
        same training run returns the first ack; once the trainer has run its last batch,
        there is nothing left to stop and the answer (not ok) comes without asking."""
        if self.halt_ack is not None and self.halt_ack.ok:
            return self.halt_ack
        state = getattr(self, "_offloop_state", None)
        if state is not None and _run_is_over(state):
            ack = Ack("", 0, "halt", False, {"step": state.timestamp.batch},
                      "the run had already trained its last batch: nothing left to halt")
        else:
            ack = super().halt(reason)
        self.halt_ack = ack
        return ack

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


# ---------------------------------------------------------------------- the built-ins


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


class LogMetricsCallback(TrainerCallback):
    """Logs the latest value of every metric in the run history: 'train'-prefixed ones at the
    end of a training epoch, the others after each evaluation.

    By default through the worker's logger (the console unless the worker was given other
    destinations), and, given `jsonl_path`, to a JSONL file with one line per logged step:
    {"step", "epoch", "time", **metrics}, the train and eval metrics of an epoch's end on
    one line. Subclass and override `log_metrics(trainer, metrics)` to log elsewhere.
    """

    jsonl_path: str | os.PathLike | None = None

    def __init__(self, jsonl_path: str | os.PathLike | None = None) -> None:
        if jsonl_path is not None and not isinstance(jsonl_path, (str, os.PathLike)):
            raise TypeError(f"jsonl_path must be a path, got {jsonl_path!r}")
        self.jsonl_path = jsonl_path

    def on_train_step_end(self, trainer, **kwargs):
        self._write_lines(before=trainer.state.timestamp.batch)  # the last step's line is whole

    def on_train_epoch_end(self, trainer, **kwargs):
        names = [n for n in sorted(trainer.run_history.get_metric_names()) if n.startswith("train")]
        self._log_latest_metrics(trainer, names)

    def on_eval_epoch_end(self, trainer, **kwargs):
        names = [n for n in sorted(trainer.run_history.get_metric_names()) if not n.startswith("train")]
        self._log_latest_metrics(trainer, names)

    def on_training_run_end(self, trainer, **kwargs):
        self._write_lines()

    def close(self, state, logger) -> None:
        self._write_lines()
        jsonl = self.__dict__.pop("_jsonl", None)
        if jsonl is not None:
            jsonl.close()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_jsonl", None)
        return state

    def _log_latest_metrics(self, trainer, metric_names: list[str]) -> None:
        if metric_names:
            history = trainer.run_history
            self.log_metrics(trainer, {name: history.get_latest_metric(name) for name in metric_names})

    def log_metrics(self, trainer, metrics: dict) -> None:
        """Where the metrics go: the worker's logger, and the JSONL file when configured."""
        step = trainer.state.timestamp.batch
        if trainer.logger is not None:
            trainer.logger.log_metrics(metrics, step=step)
        else:
            for name, value in metrics.items():
                trainer.print(f"{name}: {value}")
        if self.jsonl_path is not None:
            pending = self.__dict__.setdefault("_pending", {})
            line = pending.setdefault(step, {"step": step, "epoch": trainer.run_history.current_epoch,
                                             "time": time.time()})
            line.update({name: _json_value(value) for name, value in metrics.items()})

    def _write_lines(self, before: int | None = None) -> None:
        pending = self.__dict__.get("_pending")
        if not pending:
            return
        due = sorted(step for step in pending if before is None or step < before)
        if not due:
            return
        jsonl = self.__dict__.get("_jsonl")
        if jsonl is None:
            path = Path(self.jsonl_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            jsonl = self._jsonl = path.open("a", buffering=1)
        for step in due:
            jsonl.write(json.dumps(pending.pop(step)) + "\n")


def _json_value(value: Any) -> Any:
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    return value if isinstance(value, (int, float, str, bool)) or value is None else str(value)


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


class ProgressBarCallback(TrainerCallback):
    """A progress bar for each training and evaluation epoch: tqdm's when tqdm is installed,
    else a plain text bar (redrawn in place on a terminal, one line per epoch otherwise).
    `file` is where it is drawn (default: standard error)."""

    file: TextIO | None = None
    pbar = None
    eval_pbar = None

    def __init__(self, file: TextIO | None = None) -> None:
        self.file = file
        self.pbar = None
        self.eval_pbar = None

    def on_train_epoch_start(self, trainer, **kwargs):
        self._close("pbar")
        self.pbar = _progress_bar(trainer.state.dataloader_len,
                                  f"epoch {trainer.run_history.current_epoch}", self.file)

    def on_train_step_end(self, trainer, **kwargs):
        if self.pbar is None:  # joined mid-epoch
            self.on_train_epoch_start(trainer)
        self.pbar.update(max(trainer.state.timestamp.batch_in_epoch - self.pbar.n, 0))

    def on_train_epoch_end(self, trainer, **kwargs):
        self._close("pbar")

    def on_eval_epoch_start(self, trainer, dataloader_label=None, **kwargs):
        self._close("eval_pbar")
        label = dataloader_label or "eval"
        total = (trainer.state.config.get("eval_dataloaders") or {}).get(label)
        self.eval_pbar = _progress_bar(total, label, self.file)

    def on_eval_step_end(self, trainer, **kwargs):
        if self.eval_pbar is not None:
            self.eval_pbar.update(1)

    def on_eval_epoch_end(self, trainer, **kwargs):
        self._close("eval_pbar")

    def close(self, state, logger) -> None:
        self._close("pbar")
        self._close("eval_pbar")

    def _close(self, name: str) -> None:
        bar = getattr(self, name, None)
        if bar is not None:
            bar.close()
            setattr(self, name, None)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update(pbar=None, eval_pbar=None)
        return state


def _progress_bar(total: int | None, desc: str, file: TextIO | None):
    try:
        from tqdm import tqdm
    except ImportError:
        return _TextBar(total, desc, file)
    return tqdm(total=total, desc=desc, file=file)


class _TextBar:
    """The part of tqdm's interface ProgressBarCallback uses, for when tqdm is absent."""

    width = 30

    def __init__(self, total: int | None, desc: str, file: TextIO | None) -> None:
        self.total, self.desc, self.n = total, desc, 0
        self.file = file if file is not None else sys.stderr
        isatty = getattr(self.file, "isatty", None)
        self._live = bool(isatty and isatty())
        self._start = time.monotonic()
        self._closed = False

    def update(self, n: int = 1) -> None:
        self.n += n
        if self._live:
            self.file.write("\r" + self._line())
            self.file.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.file.write(("\r" if self._live else "") + self._line() + "\n")
        self.file.flush()

    def _line(self) -> str:
        elapsed = time.monotonic() - self._start
        if not self.total:
            return f"{self.desc}: {self.n} [{elapsed:.1f}s]"
        done = min(self.n / self.total, 1.0)
        bar = "#" * int(done * self.width)
        return f"{self.desc}: {done:4.0%}|{bar:<{self.width}}| {self.n}/{self.total} [{elapsed:.1f}s]"


def _new_value(callback: TrainerCallback, trainer, metric: str) -> Any:
    """The watched metric's value if an evaluation has added one since the last call, else
    None: with several eval dataloaders, each eval_end is not a new value of every metric."""
    history = trainer.run_history
    values = history.get_metric_values(metric)
    if not values:
        if not callback.__dict__.get("_warned") and history.get_metric_names():
            callback._warned = True
            trainer.print(f"{type(callback).__name__}: watch_metric {metric!r} is not in the run "
                          f"history; it has {', '.join(sorted(history.get_metric_names()))}")
        return None
    key = (history.generation, len(values))
    if callback.__dict__.get("_seen") == key:
        return None
    callback._seen = key
    return values[-1]


def _better(current: Any, best: Any, greater_is_better: bool) -> bool:
    """np.greater / np.less, as pytorch-accelerated compares."""
    return bool(current > best) if greater_is_better else bool(current < best)


def _check_watch(watch_metric: Any, greater_is_better: Any, reset_on_train: Any) -> None:
    if not isinstance(watch_metric, str) or not watch_metric:
        raise ValueError(f"watch_metric must be a run-history metric name, got {watch_metric!r}")
    for name, value in (("greater_is_better", greater_is_better), ("reset_on_train", reset_on_train)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")


class SaveBestModelCallback(TrainerCallback):
    """Keeps the best model of a training run by `watch_metric`.

    At the end of each epoch (`on_training_run_epoch_end`, after the epoch's evaluation, as
    pytorch-accelerated does), on an improvement (the first value counts as one) it asks the trainer for a checkpoint
    tagged 'best' and links (or copies) the file the ack names to `save_path`, worker-side
    (a relative `save_path` is relative to the worker's working directory). It records
    `best_metric`, `best_metric_epoch`, `best_metric_step` (the step evaluated), and for the
    file in `save_path`: `best_checkpoint` (the trainer's file), `best_checkpoint_step` (the
    step it holds: the trainer's first batch boundary after the request, so at least one batch
    after the evaluation) and `saved_metric`.

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
        _check_watch(watch_metric, greater_is_better, reset_on_train)
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

    def on_training_run_start(self, trainer, **kwargs):
        if self.reset_on_train:
            self.best_metric = self.best_metric_epoch = self.best_metric_step = None

    def on_training_run_epoch_end(self, trainer, **kwargs):
        current = _new_value(self, trainer, self.watch_metric)
        if current is None:
            return
        if self.best_metric is not None and not _better(current, self.best_metric, self.greater_is_better):
            return
        self.best_metric = current
        self.best_metric_epoch = trainer.run_history.current_epoch
        self.best_metric_step = trainer.state.timestamp.batch
        self._save(trainer, current)

    def _save(self, trainer, metric: Any) -> None:
        if _run_is_over(trainer.state):
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
        _check_watch(watch_metric, greater_is_better, reset_on_train)
        self.early_stopping_patience = early_stopping_patience
        self.early_stopping_threshold = early_stopping_threshold
        self.watch_metric = watch_metric
        self.greater_is_better = greater_is_better
        self.reset_on_train = reset_on_train
        self.early_stopping_patience_counter = 0
        self.best_metric = None
        self.stopped_epoch: int | None = None
        self.stopped_step: int | None = None

    def on_training_run_start(self, trainer, **kwargs):
        self.stopped_epoch = self.stopped_step = None
        if self.reset_on_train:
            self.best_metric = None
            self.early_stopping_patience_counter = 0

    def on_training_run_epoch_end(self, trainer, **kwargs):
        if self.stopped_epoch is not None:
            return  # it has asked to stop this run; epochs the halt arrives too late for change nothing
        current = _new_value(self, trainer, self.watch_metric)
        if current is None:
            return
        if self.best_metric is None:
            self.best_metric = current
        else:
            is_improvement = _better(current, self.best_metric, self.greater_is_better)
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
