"""The bus's error hierarchy: one base type, one subclass per way things fail."""

from __future__ import annotations

__all__ = ["BusError", "WireError", "RunNotFound", "ControlTimeout", "PublisherSilent",
           "ReadOnlyError"]


class BusError(Exception):
    """Base of every error the bus raises on purpose."""


class WireError(BusError, ValueError):
    """Bytes that are not a valid offloop wire v2 message (docs/protocol.md): the one error
    decoding raises."""


class RunNotFound(BusError):
    """A run directory, name or endpoint that names no reachable run."""


class ControlTimeout(BusError):
    """A control request that got no acknowledgement before its deadline."""


class PublisherSilent(BusError):
    """No heartbeat from a publisher within the subscriber's timeout."""


class ReadOnlyError(BusError, AttributeError):
    """A change to a value the bus hands out read-only (a Timestamp, a worker's State)."""
