"""Wait for a quiet machine between benchmark cases.

A case leaves work behind it: wandb's service process writing what was logged, a
TensorBoard writer thread, offloop's worker finishing its callbacks and loggers. With a
fixed short pause between cases that work runs into the next case's timed span and is
charged to it, always to the same case when the order is fixed. loggers.py and
integrations.py run several consecutive epochs at a case's turn (its own leftover work
lands on its own next epoch, as in a real run) and wait for idle CPUs before each case.
"""

from __future__ import annotations

import os
import time

__all__ = ["wait_for_quiet"]


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of every CPU together, from /proc/stat; None where there is none."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already counted in user
    return total - idle, total


def wait_for_quiet(busy_below: float = 0.1, window: float = 0.1, at_most: float = 5.0) -> float:
    """Sleep until the CPUs, all together, were busy less than `busy_below` of a `window`
    (every process, this one included), or `at_most` seconds have passed; the seconds
    waited. Without /proc/stat, sleeps `window` once."""
    start = time.monotonic()
    before = _cpu_times()
    if before is None:
        time.sleep(window)
        return window
    while True:
        time.sleep(window)
        after = _cpu_times()
        busy, total = after[0] - before[0], after[1] - before[1]
        if total > 0 and busy / total < busy_below or time.monotonic() - start >= at_most:
            return time.monotonic() - start
        before = after


if __name__ == "__main__":  # how quiet the machine is now
    print(f"quiet after {wait_for_quiet():.2f} s ({os.cpu_count()} CPUs)")
