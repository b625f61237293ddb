"""Metric values as plain Python numbers: the one place a worker turns 0-d tensors and numpy
numbers into ints and floats, for destinations, stoppers and exporters alike."""

from __future__ import annotations

from typing import Any

__all__ = ["as_scalar", "as_float"]


def as_scalar(value: Any) -> Any:
    """A 0-d tensor or numpy number as a Python number; anything else as it is."""
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return value.item()
    return value


def as_float(value: Any) -> float | None:
    """A number (a 0-d tensor or numpy number too) as a float; None for anything else:
    bools, strings, None, tensors of more than one value."""
    value = as_scalar(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)
