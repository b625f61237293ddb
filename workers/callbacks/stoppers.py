"""Composer's `ThresholdStopper` and `EarlyStopper`, deciding in a worker process.

Each decides on the published metrics with Composer's rules and asks for a halt once;
the request travels from a background thread, so the worker keeps reading events
while the trainer applies it at its next batch boundary.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

from offloop.bus import Time, TimeUnit
from offloop.bus.duration import DurationError
from offloop.workers.callback import Callback
from offloop.workers.callbacks._halting import BackgroundHalt
from offloop.workers.scalars import as_float, as_scalar
from offloop.workers.state import Timestamp

__all__ = ["ThresholdStopper", "EarlyStopper"]

_LOWER_IS_BETTER = ("loss", "error", "perplexity")
_COMPARISONS = {"gt": operator.gt, "greater": operator.gt, "lt": operator.lt, "less": operator.lt}


def _comparison(owner: str, monitor: str, comp: Any) -> Callable[[Any, Any], Any]:
    """Composer's default: less for loss/error/perplexity metrics, greater otherwise."""
    if comp is None:
        lower = any(word in monitor.lower() for word in _LOWER_IS_BETTER)
        return operator.lt if lower else operator.gt
    if isinstance(comp, str):
        try:
            return _COMPARISONS[comp.lower()]
        except KeyError:
            raise ValueError(f"{owner}: comp {comp!r} is not one of 'gt', 'greater', 'lt', 'less' "
                             "or a callable comparison") from None
    if callable(comp):
        return comp
    raise TypeError(f"{owner}: comp must be None, a string or a callable, got {type(comp).__name__}")


def _holds(comp: Callable[[Any, Any], Any], value: float, other: float) -> bool:
    """comp(value, other) as a bool; torch comparisons (torch.greater) get tensors, as in Composer."""
    try:
        return bool(comp(value, other))
    except TypeError:
        import torch

        return bool(comp(torch.as_tensor(value), torch.as_tensor(other)))


def _pick_comparison(owner: str, comp: Any, comparison: Any) -> Any:
    if comp is not None and comparison is not None:
        raise TypeError(f"{owner}: pass comp= or comparison= (the same option), not both")
    return comp if comp is not None else comparison


def _scalar(owner: str, monitor: str, label: str, value: Any) -> float:
    number = as_float(value)
    if number is None:
        kind = type(as_scalar(value)).__name__
        raise ValueError(f"{owner}: metric {monitor!r} of {label!r} is a {kind}, not a number; "
                         "monitor a scalar metric")
    return number


class _Stopper(BackgroundHalt, Callback):
    """Reads the monitored value and sends one halt request from a background thread."""

    def __init__(self, monitor: str, dataloader_label: str) -> None:
        if not isinstance(monitor, str) or not monitor:
            raise ValueError(f"{type(self).__name__}: monitor must be a metric name, got {monitor!r}")
        if not isinstance(dataloader_label, str) or not dataloader_label:
            raise ValueError(f"{type(self).__name__}: dataloader_label must be 'train', 'eval' or an "
                             f"eval dataloader label, got {dataloader_label!r}")
        self.monitor, self.dataloader_label = monitor, dataloader_label
        self._init_halt()  # halted_at, halt_ack (`.ok`, `.result['step']`), halt_error
        self.halt_reason = ""
        self._train_values: dict[str, Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (the trainer sends each callback to its worker process): no thread."""
        return {**self.__dict__, "_sender": None}

    # ------------------------------------------------------------- reading

    def _value(self, state) -> float:
        """The monitored metric now: eval metrics by label, or the train loss / batch_end field."""
        label, name = self.dataloader_label, self.monitor
        if label == "train":
            value = state.loss if name == "loss" else self._train_values.get(name)
            known = ["loss", *sorted(self._train_values)]
        else:
            metrics = state.eval_metrics.get(label, {})
            value, known = metrics.get(name), sorted(metrics)
        if value is None:
            raise ValueError(f"{type(self).__name__}: couldn't find the metric {name!r} with the "
                             f"dataloader label {label!r} (it has {known}); set dataloader_label to "
                             "'train', 'eval' or the eval dataloader's label")
        return _scalar(type(self).__name__, name, label, value)

    def _remember_train_values(self, state) -> None:
        for values in (state.data, state.train_metrics):  # batch_end's fields, log_metrics()'s
            for key, value in values.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._train_values[key] = value

    # ------------------------------------------------------------- halting

    def _halt_once(self, state, logger, reason: str) -> None:
        if self.halted_at is not None:
            return
        where = f"epoch {state.timestamp.epoch}, batch {state.timestamp.batch}"
        self.halt_reason = f"{type(self).__name__} at {where}: {reason}"
        self._ask_halt(state, logger, self.halt_reason)

    def batch_end(self, state, logger) -> None:
        self._report(logger)
        if self.dataloader_label == "train":
            self._remember_train_values(state)

    def decides_on(self) -> dict[str, Any]:
        """Where Composer's stopper decides: each epoch's end for 'train', each evaluation's
        end otherwise; the trainer stops at exactly that step (a per-batch check stays
        asynchronous: it takes effect at the batch after the one it judged)."""
        return {"epoch_end": None} if self.dataloader_label == "train" else {"eval_end": None}

    def close(self, state, logger) -> None:
        self.wait(self.close_timeout)
        self._report(logger, final=True)


class ThresholdStopper(_Stopper):
    """Halt training when a metric reaches a threshold (Composer's ThresholdStopper).

    Args:
        monitor: the metric's name, e.g. 'MulticlassAccuracy' or 'loss'.
        dataloader_label: the eval dataloader's label ('eval' for a single one), or
            'train' to watch the training loss (or another numeric batch_end field).
        threshold: the value to reach.
        comp: how `comp(value, threshold)` says "reached": 'gt'/'greater', 'lt'/'less'
            or a callable. Default: less if 'loss', 'error' or 'perplexity' is in the
            name, greater otherwise. `comparison=` is accepted as the same option.
        stop_on_batch: with dataloader_label='train', check after every batch rather
            than at each epoch end.
    """

    def __init__(self, monitor: str, dataloader_label: str, threshold: float,
                 comp: str | Callable[[Any, Any], Any] | None = None, stop_on_batch: bool = False,
                 *, comparison: str | Callable[[Any, Any], Any] | None = None) -> None:
        super().__init__(monitor, dataloader_label)
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
            raise ValueError(f"ThresholdStopper: threshold must be a number, got {threshold!r}")
        self.threshold = float(threshold)
        self.comp_func = _comparison("ThresholdStopper", monitor,
                                     _pick_comparison("ThresholdStopper", comp, comparison))
        self.stop_on_batch = bool(stop_on_batch)

    def _check(self, state, logger) -> None:
        if self.halted_at is not None:
            return
        value = self._value(state)
        if _holds(self.comp_func, value, self.threshold):
            self._halt_once(state, logger, f"{self.monitor} on {self.dataloader_label} is {value:.6g}, "
                                           f"past the threshold {self.threshold:.6g}")

    def eval_end(self, state, logger) -> None:
        if self.dataloader_label != "train" and state.dataloader_label == self.dataloader_label:
            self._check(state, logger)

    def epoch_end(self, state, logger) -> None:
        if self.dataloader_label == "train":
            self._check(state, logger)

    def batch_end(self, state, logger) -> None:
        super().batch_end(state, logger)
        if self.stop_on_batch and self.dataloader_label == "train":
            self._check(state, logger)


class EarlyStopper(_Stopper):
    """Halt training when a metric has not improved for `patience` (Composer's EarlyStopper).

    Args:
        monitor: the metric's name.
        dataloader_label: the eval dataloader's label ('eval' for a single one), or
            'train' for the training loss (or another numeric batch_end field).
        comp: how `comp(value, best)` says "better": 'gt'/'greater', 'lt'/'less' or a
            callable. Default: less if 'loss', 'error' or 'perplexity' is in the name,
            greater otherwise. `comparison=` is accepted as the same option.
        min_delta: an improvement must exceed the best value by more than this.
        patience: how long the metric may go without improving: an int (epochs), or a
            Time / time string in epochs or batches ('2ep', '100ba'). Training stops
            once more than that has passed since the best value.
    """

    def __init__(self, monitor: str, dataloader_label: str,
                 comp: str | Callable[[Any, Any], Any] | None = None, min_delta: float = 0.0,
                 patience: int | str | Time = 1, *,
                 comparison: str | Callable[[Any, Any], Any] | None = None) -> None:
        super().__init__(monitor, dataloader_label)
        self.comp_func = _comparison("EarlyStopper", monitor,
                                     _pick_comparison("EarlyStopper", comp, comparison))
        if isinstance(min_delta, bool) or not isinstance(min_delta, (int, float)):
            raise ValueError(f"EarlyStopper: min_delta must be a number, got {min_delta!r}")
        self.min_delta = abs(float(min_delta))
        self.patience = _patience(patience)
        self.best: float | None = None
        self.best_occurred: Timestamp | None = None

    def state_dict(self) -> dict[str, Any]:
        """The best value and when it occurred: a resumed run waits out the same patience."""
        return {"best": self.best, "best_occurred": self.best_occurred} if self.best is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.best_occurred = state.get("best"), state.get("best_occurred")

    def _update(self, state, logger) -> None:
        if self.halted_at is not None:
            return
        value = self._value(state)
        if self.best is None or (_holds(self.comp_func, value, self.best)
                                 and abs(value - self.best) > self.min_delta):
            self.best, self.best_occurred = value, state.timestamp
        unit = self.patience.unit
        waited = state.timestamp.get(unit) - self.best_occurred.get(unit)
        if waited > self.patience.value:
            self._halt_once(state, logger, (
                f"{self.monitor} on {self.dataloader_label} has not improved on {self.best:.6g} "
                f"(epoch {self.best_occurred.epoch}, batch {self.best_occurred.batch}) for "
                f"{waited}{unit.value}, more than the patience of {self.patience}"))

    def eval_end(self, state, logger) -> None:
        if self.dataloader_label != "train" and state.dataloader_label == self.dataloader_label:
            self._update(state, logger)

    def epoch_end(self, state, logger) -> None:
        if self.dataloader_label == "train":
            self._update(state, logger)

    def batch_end(self, state, logger) -> None:
        super().batch_end(state, logger)
        if self.patience.unit is TimeUnit.BATCH and self.dataloader_label == "train":
            self._update(state, logger)


def _patience(patience: Any) -> Time:
    if isinstance(patience, bool):
        raise ValueError(f"EarlyStopper: patience must be an int of epochs or a time string, got {patience!r}")
    if isinstance(patience, int):
        if patience < 0:
            raise ValueError(f"EarlyStopper: patience must be >= 0, got {patience}")
        return Time(patience, TimeUnit.EPOCH)
    try:
        parsed = Time.parse(patience)
    except DurationError as exc:
        raise ValueError(f"EarlyStopper: patience: {exc}") from None
    if parsed.unit not in (TimeUnit.EPOCH, TimeUnit.BATCH):
        raise ValueError(f"EarlyStopper: patience {patience!r} must be in epochs or batches "
                         "(e.g. 2, '2ep' or '100ba')")
    return parsed
