"""Deliveries: a worker's calls to its logger destinations, made on a thread of their own.

A destination can be slow: a tracking server across a network, TensorBoard's first import
(seconds), an artifact upload. Called inline, it would hold up the worker's next event,
and where the trainer awaits that worker's decision (a CheckpointSaver at an epoch's end,
an EarlyStopper at an eval's end) the training loop would wait for the logger too. Here
the callbacks' thread only queues each call; one thread makes them, in the order queued.
"""

from __future__ import annotations

import sys
import threading
import traceback
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["Deliveries", "MAX_QUEUED"]

#: calls that may wait for the destinations at once; past this many, a log_* call is
#: dropped and counted (a day-long outage of a tracking server must not fill the memory)
MAX_QUEUED = 100_000


class Deliveries:
    """`deliver(method, args)` called on a thread of its own for each `put()`, in order.

    Only log_* calls are ever dropped (when MAX_QUEUED wait; counted in `dropped`, said on
    stderr); init, flush and close always wait their turn."""

    def __init__(self, deliver: Callable[[str, tuple], Any], max_queued: int = MAX_QUEUED) -> None:
        self._deliver = deliver
        self.max_queued = max_queued
        self.dropped = 0
        self._calls: deque[tuple[str, tuple]] = deque()
        self._changed = threading.Condition()
        self._busy = False  # a call is being made
        self._closing = False
        self._thread = threading.Thread(target=self._run, daemon=True, name="offloop-loggers")
        self._thread.start()

    @property
    def queued(self) -> int:
        """Calls not made yet (the one being made included)."""
        return len(self._calls) + self._busy

    def put(self, method: str, args: tuple) -> None:
        with self._changed:
            if self._closing:  # after close(): nothing is left to make it later
                self._call(method, args)
                return
            if len(self._calls) >= self.max_queued and method.startswith("log_"):
                self.dropped += 1
                if self.dropped == 1 or self.dropped % 1000 == 0:
                    print(f"offloop logger: a {method} call was dropped ({self.dropped} so far): "
                          f"{len(self._calls)} calls already wait for destinations that are not keeping up",
                          file=sys.stderr, flush=True)
                return
            self._calls.append((method, args))
            self._changed.notify_all()

    def after(self, then: Callable[[], Any]) -> None:
        """Call `then()` on the delivering thread once every call queued before it is made."""
        self.put("", (then,))

    def wait(self, timeout: float | None = None) -> bool:
        """Until every call queued so far has been made; False if `timeout` passed first."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._calls and not self._busy, timeout)

    def close(self) -> None:
        """Make every queued call, then end the thread (a destination that never returns
        keeps it: a worker's process is ended by its trainer's shutdown timeout)."""
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._changed:
                self._busy = False
                while not self._calls:
                    if self._closing:
                        return
                    self._changed.notify_all()  # idle: wake wait()
                    self._changed.wait()
                method, args = self._calls.popleft()
                self._busy = True
            self._call(method, args)

    def _call(self, method: str, args: tuple) -> None:
        try:
            if method:
                self._deliver(method, args)
            else:  # after()
                args[0]()
        except Exception:  # deliver() reports a destination's own errors; anything else is ours
            print(f"offloop logger: delivering {method or args[0]} failed\n{traceback.format_exc()}",
                  file=sys.stderr, flush=True)
