"""Composer time strings ('3ep', '500ba', '10000sp', '1000tok') parsed once into `Time`.

Shared by the trainer (max_duration, eval_interval) and the workers (save_interval,
patience), so both read a duration the same way.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

__all__ = ["Time", "TimeUnit", "DurationError"]


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
