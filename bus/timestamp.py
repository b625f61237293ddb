"""`Timestamp`: counters of completed training work, named as Composer's, read-only.

Promise: a Timestamp never changes (the trainer moves on to a new one, as Composer's
does), and `as_tuple()` (or `wire`) is one tuple object for the whole life of a Timestamp.
"""

from __future__ import annotations

from typing import Any

from offloop.bus.duration import COUNTS, TimeUnit
from offloop.bus.errors import ReadOnlyError

__all__ = ["Timestamp", "FIELDS"]

#: The counters, in the order Timestamp() takes them: the five the wire carries first.
FIELDS = ("epoch", "batch", "batch_in_epoch", "sample", "token",
          "sample_in_epoch", "token_in_epoch", "epoch_in_iteration", "iteration")

_new = object.__new__

#: each counter's unit, for Timestamp.counted (the iteration counters have none)
_COUNT_OF = {"epoch": COUNTS[TimeUnit.EPOCH], "batch": COUNTS[TimeUnit.BATCH],
             "batch_in_epoch": COUNTS[TimeUnit.BATCH], "sample": COUNTS[TimeUnit.SAMPLE],
             "token": COUNTS[TimeUnit.TOKEN], "sample_in_epoch": COUNTS[TimeUnit.SAMPLE],
             "token_in_epoch": COUNTS[TimeUnit.TOKEN], "epoch_in_iteration": COUNTS[TimeUnit.EPOCH]}


class Timestamp:
    """Counters of completed work; `batch` counts optimizer steps over the whole run.

    Every event carries the first five (`as_tuple()`), so a worker's Timestamp has those
    and reads 0 for the per-epoch sample and token counts and the iteration counters.
    `to_next_batch()`, `to_next_epoch()` and `to_next_iteration()` return a new one.

    `as_tuple()` gives the same tuple object every time it is called on one Timestamp:
    the events published between two steps share it, and `Publisher.publish` packs an
    event's ts only where it is not the very object the event before it had. `wire` is
    that tuple as an attribute: the training loop reads it at every event, where a call
    would be a Python frame each time.
    """

    epoch: int
    batch: int
    batch_in_epoch: int
    sample: int
    token: int
    sample_in_epoch: int
    token_in_epoch: int
    epoch_in_iteration: int
    iteration: int
    wire: tuple[int, int, int, int, int]

    def __init__(self, epoch: int = 0, batch: int = 0, batch_in_epoch: int = 0, sample: int = 0,
                 token: int = 0, sample_in_epoch: int = 0, token_in_epoch: int = 0,
                 epoch_in_iteration: int = 0, iteration: int = 0) -> None:
        # written through __dict__: __setattr__ refuses every change
        self.__dict__.update(epoch=epoch, batch=batch, batch_in_epoch=batch_in_epoch, sample=sample,
                             token=token, sample_in_epoch=sample_in_epoch,
                             token_in_epoch=token_in_epoch,
                             epoch_in_iteration=epoch_in_iteration, iteration=iteration,
                             wire=(epoch, batch, batch_in_epoch, sample, token))

    @classmethod
    def counted(cls, *counters: int) -> Timestamp:
        """A Timestamp whose counters read as Composer's Time (`ts.epoch.value`,
        `ts.batch >= '100ba'`; bus.duration.Count), ints all the same: what callbacks and
        algorithms see. The trainer's own stay plain ints (built every step)."""
        values = dict(zip(FIELDS, counters, strict=False))
        return cls(**{name: _COUNT_OF[name](values.get(name, 0)) if name in _COUNT_OF
                      else values.get(name, 0)
                      for name in FIELDS})

    def __setattr__(self, name: str, value: Any) -> None:
        raise ReadOnlyError(f"cannot set timestamp.{name}: a Timestamp is read-only (the trainer "
                            "moves on to a new one at every batch, as Composer's does)")

    __delattr__ = __setattr__

    def as_tuple(self) -> tuple[int, int, int, int, int]:
        """(epoch, batch, batch_in_epoch, sample, token), what every event carries: the same
        tuple object at every call (see the class docstring)."""
        return self.wire

    def get(self, unit: Any) -> int:
        """The counter for a TimeUnit ('ep', 'ba', 'sp', 'tok')."""
        return self.__dict__[unit.counter]

    def to_next_batch(self, samples: int, tokens: int) -> Timestamp:
        """The Timestamp one optimizer step later (the step trained `samples` and `tokens`).
        Called once a step: the new one copies this one's counters in one C call."""
        old = self.__dict__
        new = _new(Timestamp)
        counters = new.__dict__
        counters.update(old)
        counters["batch"] = batch = old["batch"] + 1
        counters["batch_in_epoch"] = batch_in_epoch = old["batch_in_epoch"] + 1
        counters["sample"] = sample = old["sample"] + samples
        counters["token"] = token = old["token"] + tokens
        counters["sample_in_epoch"] = old["sample_in_epoch"] + samples
        counters["token_in_epoch"] = old["token_in_epoch"] + tokens
        counters["wire"] = (old["epoch"], batch, batch_in_epoch, sample, token)
        return new

    def to_next_epoch(self) -> Timestamp:
        return Timestamp(self.epoch + 1, self.batch, 0, self.sample, self.token, 0, 0,
                         self.epoch_in_iteration + 1, self.iteration)

    def to_next_iteration(self) -> Timestamp:
        return Timestamp(*(getattr(self, name) for name in FIELDS[:-2]), 0, self.iteration + 1)

    def state_dict(self) -> dict[str, int]:
        return {name: self.__dict__[name] for name in FIELDS}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> Timestamp:
        """The Timestamp a checkpoint's state_dict() holds (counters it lacks are 0)."""
        return cls(**{name: int(state.get(name, 0)) for name in FIELDS})

    def _counters(self) -> tuple[int, ...]:
        return tuple(self.__dict__[name] for name in FIELDS)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Timestamp):
            return NotImplemented
        return self._counters() == other._counters()

    def __hash__(self) -> int:
        return hash(self._counters())

    def __repr__(self) -> str:
        return "Timestamp(" + ", ".join(f"{name}={self.__dict__[name]}" for name in FIELDS) + ")"
