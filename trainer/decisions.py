"""Where the trainer waits for its workers' decisions, so that they take effect at exactly
the step where Composer's in-process callbacks would take them.

A callback declares where it decides (`decides_on()`: an EarlyStopper at each eval's end,
a CheckpointSaver at the checkpoint events of its interval). At such an event, and only
there, the trainer marks the event as awaited (AWAITS: an id and the workers named),
sends it at once, and waits until those workers have handled it, answering their halt and
checkpoint requests meanwhile; every other event and batch goes on without waiting. A
worker that does not answer within `decision_timeout` is reported once and from then on
treated as asynchronous (its requests take effect at the first batch after they arrive).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

from offloop.bus import AWAITS, DECISION_EVENTS, Time, Timestamp, TimeUnit
from offloop.bus.duration import DurationError
from offloop.trainer.errors import ConfigError

__all__ = ["Decisions", "decision_schedule"]

log = logging.getLogger("offloop.trainer")
_KEEP_WAITS = 10_000


class Decisions:
    """The declared decision points of each worker, and the waits at them: `fire()` is
    handed the emitter, the workers and the run's `Control` (whose `serve()` answers
    requests while it waits: a halt is applied, a checkpoint written) and knows no Trainer.
    A request wakes a wait only where the control server calls `workers.wake` on arrival
    (RunServices wires it)."""

    def __init__(self, schedule: dict[str, list[tuple[int, Time | None]]], timeout: float,
                 emitter, workers, control) -> None:
        self.schedule = schedule  # decision_schedule()'s
        self.timeout = timeout
        self._emitter, self._workers, self._control = emitter, workers, control
        self.ident = 0  # the id of the last awaited event
        # seconds each of the latest waits took (benchmarks/control_latency.py), and of it
        # serving requests (a checkpoint's write, say); bounded: a '1ba' interval waits at
        # every batch
        self.waits: deque[float] = deque(maxlen=_KEEP_WAITS)
        self.served: deque[float] = deque(maxlen=_KEEP_WAITS)
        self._gave_up: set[int] = set()  # workers that missed a wait: asynchronous from then on

    def fire(self, topic: str, ts: Timestamp, data: dict | None = None) -> None:
        """Publish `topic` (`data` may hold tensors); where a worker decides on it now, send
        it at once and wait for that worker's answer, its requests served meanwhile
        (`Control.serve(topic, ts)`)."""
        # the usual event, where no worker decides, costs a dict lookup (no call)
        indexes = self.due(topic, ts) if topic in self.schedule else None
        if not indexes:
            if data is None:
                self._emitter.emit(topic, ts.wire)
            else:
                self._emitter.emit_tensors(topic, ts.as_tuple(), data)
            return
        self._emitter.emit_tensors(
            topic, ts.as_tuple(), {**(data or {}), AWAITS: self.awaits(indexes)}
        )
        self._emitter.flush()  # the event leaves now (on CUDA: its tensors copied first)
        start, served = time.perf_counter(), [0.0]

        def serve() -> None:
            began = time.perf_counter()
            self._control.serve(topic, ts)
            served[0] += time.perf_counter() - began

        late = self._workers.wait_answers(indexes, self.ident, self.timeout, serve)
        self.waits.append(time.perf_counter() - start)
        self.served.append(served[0])
        for index in late:
            self._gave_up.add(index)
            log.warning(
                "offloop: callback worker %s did not answer %s within %gs (decision_timeout); its "
                "decisions take effect at the batch after they arrive from now on",
                self._workers.workers[index].name,
                topic,
                self.timeout,
            )

    def due(self, topic: str, ts: Timestamp) -> list[int]:
        """The workers to wait for at `topic` now (usually none)."""
        entries = self.schedule.get(topic)
        if not entries:
            return []
        return sorted(
            {
                index
                for index, every in entries
                if index not in self._gave_up
                and (every is None or ts.get(every.unit) % every.value == 0)
            }
        )

    def awaits(self, indexes: list[int]) -> dict[str, Any]:
        """The AWAITS value of the next awaited event."""
        self.ident += 1
        return {"id": self.ident, "workers": indexes}


def decision_schedule(groups: list[list]) -> dict[str, list[tuple[int, Time | None]]]:
    """topic -> [(worker index, interval or None)] for callbacks grouped by worker process;
    ConfigError naming the callback whose decides_on() is not valid."""
    schedule: dict[str, list[tuple[int, Time | None]]] = {}
    for index, group in enumerate(groups):
        for callback in group:
            for topic, interval in _declared(callback).items():
                schedule.setdefault(topic, []).append((index, interval))
    return schedule


def _declared(callback: Any) -> dict[str, Time | None]:
    """A callback's decides_on(), checked: ConfigError naming the callback otherwise."""
    decides_on = getattr(callback, "decides_on", None)
    if decides_on is None:
        return {}
    name = type(callback).__name__
    declared = decides_on()
    if not isinstance(declared, dict):
        raise ConfigError(
            f"callback {name}: decides_on() must return a dict of event name -> interval, "
            f"got {type(declared).__name__}"
        )
    out: dict[str, Time | None] = {}
    for topic, interval in declared.items():
        topic = getattr(topic, "value", topic)
        if topic not in DECISION_EVENTS:
            raise ConfigError(
                f"callback {name}: decides_on() names {topic!r}; decisions can be awaited at "
                f"{', '.join(sorted(DECISION_EVENTS))}"
            )
        if interval is None:
            if DECISION_EVENTS[topic]:
                raise ConfigError(
                    f"callback {name}: decides_on() must give {topic!r} an interval in "
                    "batches ('100ba'): a wait at every batch would cost every batch"
                )
            out[topic] = None
            continue
        try:
            every = (
                Time(interval, TimeUnit.BATCH) if type(interval) is int else Time.parse(interval)
            )
        except DurationError as exc:
            raise ConfigError(f"callback {name}: decides_on()[{topic!r}]: {exc}") from None
        if (
            every.unit not in (TimeUnit.BATCH, TimeUnit.EPOCH)
            or every.value < 1
            or (DECISION_EVENTS[topic] and every.unit is not TimeUnit.BATCH)
        ):
            raise ConfigError(
                f"callback {name}: decides_on()[{topic!r}] is {interval!r}; it must be a "
                f"positive number of {'batches' if DECISION_EVENTS[topic] else 'batches or epochs'}"
            )
        out[topic] = every
    return out
