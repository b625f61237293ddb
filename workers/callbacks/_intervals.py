"""Intervals in batches or epochs ('100ba', '1ep', or an int of batches), parsed once
into a `Time` with one clear error naming the callback that was given a bad one."""

from __future__ import annotations

from typing import Any

from offloop.bus import Time, TimeUnit
from offloop.bus.duration import DurationError


def batch_or_epoch_interval(owner: str, interval: Any) -> Time:
    """`interval` as a Time in batches or epochs; ValueError naming `owner` otherwise."""
    try:
        parsed = (Time(interval, TimeUnit.BATCH) if isinstance(interval, int) and not isinstance(interval, bool)
                  else Time.parse(interval))
    except DurationError as exc:
        raise ValueError(f"{owner}: interval: {exc}") from None
    if parsed.unit not in (TimeUnit.BATCH, TimeUnit.EPOCH) or parsed.value < 1:
        raise ValueError(f"{owner}: interval {interval!r} must be a positive number of batches or "
                         "epochs (e.g. 1, '10ba', '1ep')")
    return parsed
