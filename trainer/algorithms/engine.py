"""The algorithms' side of the loop: what they are given (`LoopState`, `AlgorithmLogger`)
and the `Engine` that calls them at each event."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from offloop.bus import Event, Time, Timestamp, TimeUnit
from offloop.bus.timestamp import FIELDS
from offloop.trainer.errors import ConfigError

__all__ = ["Algorithm", "AlgorithmLogger", "Engine", "LoopState", "EVENT_TOPICS"]

#: the topics that are Composer events (the bus also carries grad_norms, checkpoint_saved, ...)
EVENT_TOPICS = {event.value: event for event in Event}


class Algorithm:
    """Composer's Algorithm: `match()` says whether to run at an event, `apply()` runs.
    `state_dict()` travels with every checkpoint; `load_state_dict()` restores it."""

    def match(self, event: Event, state: LoopState) -> bool:
        raise NotImplementedError

    def apply(self, event: Event, state: LoopState, logger: AlgorithmLogger) -> Any:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class _Live:
    """A LoopState attribute read from the trainer at each access (the trainer replaces
    some of them, such as its timestamp, as it trains)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, state: LoopState | None, owner: type) -> Any:
        return self if state is None else getattr(state._trainer, self.name)


class LoopState:
    """What an algorithm sees of the run, live, in the training process: Composer's names
    (`model`, `optimizers`, `schedulers`, `timestamp`, `max_duration`, `run_name`,
    `dataloader_label`, `rank`, `world_size`, `device`, `precision`, and
    `get_elapsed_duration()`). Unlike a callback's State it is the real thing: an
    algorithm may change the model's weights and gradients, or the optimizers."""

    model, optimizers, schedulers = _Live(), _Live(), _Live()
    max_duration, run_name, rank, world_size, device, precision = (_Live() for _ in range(6))

    def __init__(self, trainer) -> None:
        self._trainer = trainer
        self.dataloader_label: str | None = None
        self._counted: tuple = (None, None)  # (the trainer's Timestamp, its counted copy)

    @property
    def timestamp(self) -> Timestamp:
        """The trainer's Timestamp, its counters as Composer's Time (`.value`, `.unit`)."""
        live = self._trainer.timestamp
        if self._counted[0] is not live:
            self._counted = (live, Timestamp.counted(*(getattr(live, name) for name in FIELDS)))
        return self._counted[1]

    def get_elapsed_duration(self) -> float | None:
        """The fraction of max_duration trained, in its unit (Composer's; None without one)."""
        duration = self.max_duration
        if duration is None or duration.value == 0:
            return None
        return self.timestamp.get(duration.unit) / duration.value


class AlgorithmLogger:
    """Composer's Logger, as an algorithm gets it: `log_metrics()` goes where the training
    code's `log_metrics()` goes (with the step's snapshot, to every logger and callback)."""

    def __init__(self, user_metrics) -> None:
        self._metrics = user_metrics

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        self._metrics.log(metrics)


#: the events whose snapshot carries the metrics logged by then (`metrics`)
_CARRY_METRICS = frozenset({Event.BATCH_END, Event.EVAL_END, Event.PREDICT_END})


class Engine:
    """Runs the algorithms at each event, in the order given; `spent` holds each one's
    seconds on the training thread, by class name. What they log at batch_end, eval_end
    or predict_end goes out with that very event; at any other event, with the next of
    those (as the training code's log_metrics() values do)."""

    def __init__(self, algorithms: list, state: LoopState, user_metrics) -> None:
        self.algorithms, self.state, self._metrics = list(algorithms), state, user_metrics
        self.logger = AlgorithmLogger(user_metrics)
        self.spent: dict[str, float] = {type(a).__name__: 0.0 for a in self.algorithms}

    def run(self, topic: str, data: dict | None = None) -> None:
        event = EVENT_TOPICS.get(topic)
        if event is None:
            return
        if data and "dataloader_label" in data:
            self.state.dataloader_label = data["dataloader_label"]
        state, logger, clock = self.state, self.logger, time.perf_counter
        for algorithm in self.algorithms:
            start = clock()
            if algorithm.match(event, state):
                algorithm.apply(event, state, logger)
            self.spent[type(algorithm).__name__] += clock() - start
        if event in _CARRY_METRICS and self._metrics.values and isinstance(data, dict):
            data["metrics"] = {**(data.get("metrics") or {}), **self._metrics.take()}


def check_algorithms(algorithms: Any) -> list:
    """Algorithms as a list, each with Composer's match and apply."""
    if algorithms is None:
        return []
    if not isinstance(algorithms, (list, tuple)):
        algorithms = [algorithms]
    for algorithm in algorithms:
        if not (callable(getattr(algorithm, "match", None))
                and callable(getattr(algorithm, "apply", None))):
            raise ConfigError(
                f"algorithms: {type(algorithm).__name__} is not an algorithm: it needs "
                "match(event, state) and apply(event, state, logger)"
            )
    return list(algorithms)


def time_of(owner: str, name: str, value: Any, units: tuple[TimeUnit, ...]) -> Time:
    """A Composer time string (or Time) in one of `units`, or a clear error."""
    try:
        parsed = Time.parse(value)
    except ValueError as exc:
        raise ValueError(f"{owner}: {name}: {exc}") from None
    if parsed.unit not in units:
        raise ValueError(
            f"{owner}: {name} must be in {' or '.join(u.value for u in units)}, got {value!r}"
        )
    return parsed
