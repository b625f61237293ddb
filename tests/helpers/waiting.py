"""Waiting in tests: a condition with a deadline, never a bare sleep."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(condition: Callable[[], object], timeout: float = 5.0, what: str = "the condition",
               interval: float = 0.005) -> object:
    """`condition()`'s first true value; fail the test, naming `what`, after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
    return value
