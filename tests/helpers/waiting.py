"""Waiting in tests and in the programs they start: a condition with a deadline, never a
bare sleep. (Plain Python only: the programs in tests/programs/ import it too.)"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path


def wait_until(condition: Callable[[], object], timeout: float = 5.0, what: str = "the condition",
               interval: float = 0.005) -> object:
    """`condition()`'s first true value; fail the test, naming `what`, after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
    return value


def wait_for_file(path: Path, timeout: float = 30.0, interval: float = 0.02) -> None:
    """Until `path` exists (a child process's signal or output); fail the test after `timeout`."""
    wait_until(path.exists, timeout, f"{path} to appear", interval)
