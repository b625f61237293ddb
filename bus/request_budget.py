"""The CPU a thread that reads peers' requests may take from the run.

The threads that read requests (the control server's, the publisher's service thread)
share the GIL with the training thread, so a flood of requests, however cheap each one is
to refuse, slows training while they are kept busy. A `RequestBudget` bounds them: after a
round of at most `round_size` requests that took `busy` seconds of the thread's CPU, the
socket is not read again until `busy / share` seconds have passed since the round began.
Meanwhile libzmq stops reading a flooding connection once its receive queue is full, and
TCP holds the rest in the sender. A ROUTER takes its messages from its peers in turn, so a
round holds at most one peer's share of them.
"""

from __future__ import annotations

import time

__all__ = ["RequestBudget", "REQUEST_SHARE", "REQUEST_ROUND"]

#: the share of one core the request threads may take from the run, each
REQUEST_SHARE = 0.05
#: requests read in one round
REQUEST_ROUND = 16


class RequestBudget:
    """When a request socket may be read again; used by one thread."""

    def __init__(self, share: float = REQUEST_SHARE, round_size: int = REQUEST_ROUND) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"RequestBudget: share must be in (0, 1], got {share!r}")
        self.share, self.round_size = share, round_size
        self._resume = 0.0  # time.monotonic() at which the socket may be read again
        self._began = self._cpu = 0.0

    def rest(self) -> float:
        """Seconds until the next round may begin (0: now)."""
        return max(0.0, self._resume - time.monotonic())

    def begin(self) -> None:
        self._began, self._cpu = time.monotonic(), time.thread_time()

    def end(self) -> None:
        busy = time.thread_time() - self._cpu
        self._resume = self._began + busy / self.share
