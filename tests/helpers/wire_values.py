"""Values at the edge of what the wire carries, shared by the wire and pubsub tests."""

from __future__ import annotations

from offloop.bus import WireError
from offloop.bus.wire import EventEncoder


def nested(depth: int):
    """1 inside `depth` lists."""
    value = 1
    for _ in range(depth):
        value = [value]
    return value


def deepest_alone() -> int:
    """The deepest list nesting an event's data can hold and still encode as a message of
    its own (a burst holds each event two levels deeper)."""
    enc, depth = EventEncoder("r", "p", 0), 1
    while True:
        try:
            enc.encode("batch_end", 1, 1, (0, 0, 0, 0, 0), {"deep": nested(depth + 1)})
        except WireError:
            return depth
        depth += 1
