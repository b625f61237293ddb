"""Composer time strings ('3ep', '500ba', '10000sp', '1000tok') parsed once into `Time`.

Shared by the trainer (max_duration, eval_interval) and the workers (save_interval,
patience), so both read a duration the same way.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

__all__ = ["Time", "TimeUnit", "DurationError", "Count", "COUNTS"]


class DurationError(ValueError):
    """A duration string or value that is not a valid Composer time."""


class TimeUnit(str, Enum):
    EPOCH = "ep"
    BATCH = "ba"
    SAMPLE = "sp"
    TOKEN = "tok"

    @property
    def counter(self) -> str:
        """The timestamp field this unit counts."""
        return {"ep": "epoch", "ba": "batch", "sp": "sample", "tok": "token"}[self.value]


_PATTERN = re.compile(r"^\s*(\d+)\s*(ep|ba|sp|tok)\s*$")
_VALID = "an integer followed by ep, ba, sp or tok (e.g. '3ep', '500ba', '10000sp', '1000tok')"


@dataclass(frozen=True)
class Time:
    """An amount of training time in one unit."""

    value: int
    unit: TimeUnit

    def __post_init__(self) -> None:
        # the timestamp field reached() reads, looked up once: the trainer asks every batch,
        # and an Enum's property costs three Python calls
        object.__setattr__(self, "_counter", self.unit.counter)

    @classmethod
    def parse(cls, text: str | Time) -> Time:
        if isinstance(text, Time):
            return text
        if not isinstance(text, str):
            raise DurationError(f"duration {text!r} is a {type(text).__name__}; expected {_VALID}")
        match = _PATTERN.match(text)
        if not match:
            raise DurationError(f"bad duration string {text!r}: expected {_VALID}")
        return cls(int(match.group(1)), TimeUnit(match.group(2)))

    def __str__(self) -> str:
        return f"{self.value}{self.unit.value}"

    def reached(self, timestamp) -> bool:
        """Whether a timestamp (anything with epoch/batch/sample/token) is at or past this."""
        return getattr(timestamp, self._counter) >= self.value

    def crossed(self, before: int, after: int) -> bool:
        """Whether a multiple of this interval lies in (before, after]: for 'every N' schedules."""
        return self.value > 0 and after // self.value > before // self.value


class Count(int):
    """A timestamp counter read as Composer's `Time`: an int (arithmetic with numbers,
    formatting, JSON and the wire work as before) that also has `.value` and `.unit`,
    compares with a time string ('3ep') or a `Time` of its unit, and keeps its unit
    through `+`, `-`, `*` and `%` with numbers or Times of its unit (Composer's rules: a
    different unit raises). One subclass per unit, so a counter carries no dict."""

    __slots__ = ()
    unit: TimeUnit

    @property
    def value(self) -> int:
        return int(self)

    def to_timestring(self) -> str:
        return f"{int(self)}{self.unit.value}"

    def _other(self, other: object) -> int | None:
        """`other` as a number of this unit, or None where it is not one."""
        if isinstance(other, str):
            other = Time.parse(other)
        if isinstance(other, (Time, Count)) and not isinstance(other, bool):
            unit = other.unit
            if unit is not self.unit:
                raise RuntimeError(f"cannot combine {self.to_timestring()} with "
                                   f"{other.value}{unit.value}: their units differ")
            return int(other.value)
        if isinstance(other, int) and not isinstance(other, bool):
            return int(other)
        return None

    def _compare(self, other: object, op) -> bool:
        value = self._other(other)
        return NotImplemented if value is None else op(int(self), value)

    def __eq__(self, other: object) -> bool:
        return self._compare(other, int.__eq__)

    def __ne__(self, other: object) -> bool:
        return self._compare(other, int.__ne__)

    def __lt__(self, other: object) -> bool:
        return self._compare(other, int.__lt__)

    def __le__(self, other: object) -> bool:
        return self._compare(other, int.__le__)

    def __gt__(self, other: object) -> bool:
        return self._compare(other, int.__gt__)

    def __ge__(self, other: object) -> bool:
        return self._compare(other, int.__ge__)

    __hash__ = int.__hash__

    def _arith(self, other: object, op) -> Count:
        value = self._other(other)
        return NotImplemented if value is None else type(self)(op(int(self), value))

    def __add__(self, other: object) -> Count:
        return self._arith(other, int.__add__)

    __radd__ = __add__

    def __sub__(self, other: object) -> Count:
        return self._arith(other, int.__sub__)

    def __rsub__(self, other: object) -> Count:
        return self._arith(other, lambda a, b: b - a)

    def __mul__(self, other: object) -> Count:
        return self._arith(other, int.__mul__)

    __rmul__ = __mul__

    def __mod__(self, other: object) -> Count:
        return self._arith(other, int.__mod__)

    def __repr__(self) -> str:
        return f"Time({int(self)}, TimeUnit.{self.unit.name})"

    def __str__(self) -> str:
        return str(int(self))

    __format__ = int.__format__

    def __reduce__(self):
        return int, (int(self),)  # pickled as the number it is


#: one Count subclass per unit: `COUNTS[TimeUnit.EPOCH](3)`
COUNTS = {unit: type(f"{unit.name.title()}Count", (Count,), {"__slots__": (), "unit": unit})
          for unit in TimeUnit}
