"""The CPU a thread that reads peers' requests may take from the run.

The threads that read requests (the control server's, the publisher's service thread)
share the GIL with the training thread, so a flood of requests, however cheap each one is
to refuse, slows training while they are kept busy. A `RequestBudget` is a token bucket of
CPU time: it fills at `share` seconds a second up to `burst`, and each round of at most
`round_size` requests takes the thread CPU time it cost, plus, for each request read, what
it cost outside this thread: libzmq's I/O threads on both ends and the kernel's loopback
work move every message, and on a machine with no core to spare that work comes out of
training as surely as this thread's (`REQUEST_COST`, `REQUEST_BYTE_COST`: estimates, not
measured per request). While the bucket is empty the socket is not read; meanwhile libzmq
stops reading a flooding connection once its receive queue is full, and TCP holds the rest
in the sender. A request after a quiet spell is read at once (the bucket is full); a flood
gets `share` of a core on average and is read a few hundred requests a second at most. A
ROUTER takes its messages from its peers in turn, so a round holds at most one peer's
share of them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager

import zmq

__all__ = ["RequestBudget", "REQUEST_BURST", "REQUEST_BYTE_COST", "REQUEST_COST", "REQUEST_ROUND",
           "REQUEST_SHARE"]

#: the share of one core the request threads may take from the run, each, on average
REQUEST_SHARE = 0.05
#: seconds of CPU a thread may spend at once after a quiet spell (a burst of requests)
REQUEST_BURST = 0.005
#: requests read in one round
REQUEST_ROUND = 16
#: seconds charged for each request read, beyond the reading thread's CPU: its cost elsewhere
REQUEST_COST = 100e-6
#: and for each byte of it
REQUEST_BYTE_COST = 10e-9


class RequestBudget:
    """When a request socket may be read again; used by one thread."""

    def __init__(self, share: float = REQUEST_SHARE, round_size: int = REQUEST_ROUND,
                 burst: float = REQUEST_BURST) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"RequestBudget: share must be in (0, 1], got {share!r}")
        self.share, self.round_size, self.burst = share, round_size, burst
        self._credit, self._at = burst, time.monotonic()  # seconds of CPU left, and when
        self._elsewhere = 0.0  # what this round's requests cost outside this thread

    def _refill(self) -> None:
        now = time.monotonic()
        self._credit = min(self.burst, self._credit + (now - self._at) * self.share)
        self._at = now

    def rest(self) -> float:
        """Seconds until the next round may begin (0: now)."""
        self._refill()
        return 0.0 if self._credit >= 0 else -self._credit / self.share

    def poll(self, everything: zmq.Poller, quiet: zmq.Poller, timeout: float | None = None) -> list:
        """`everything.poll` when a round may begin; else `quiet.poll` (the same sockets
        but the request socket) until one may. `timeout` in seconds, None: no limit."""
        rest = self.rest()
        if not rest:
            return everything.poll(None if timeout is None else math.ceil(timeout * 1000))
        return quiet.poll(math.ceil(1000 * (rest if timeout is None else min(rest, timeout))))

    def read(self, frames: list) -> None:
        """Charge this round for a request read (its frames, zmq.Frame or bytes)."""
        self._elsewhere += REQUEST_COST + REQUEST_BYTE_COST * sum(len(f) for f in frames)

    @contextmanager
    def round(self) -> Iterator[None]:
        """A round of requests: the thread CPU time it takes comes out of the bucket, and
        what `read` charged for its requests."""
        cpu, self._elsewhere = time.thread_time(), 0.0
        try:
            yield
        finally:
            self._refill()
            self._credit -= time.thread_time() - cpu + self._elsewhere
