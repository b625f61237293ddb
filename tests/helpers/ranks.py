"""A torchrun run seen from outside, as the torchrun tests (one node and two) watch it:
its run.json once rank 0 has written it, and every rank's events to the end."""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

from offloop.bus import RunNotFound, Subscriber, find_run


def torchrun_command() -> list[str]:
    """This interpreter's torchrun (the one beside it), or its module where none is."""
    script = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    return [script] if script else [sys.executable, "-m", "torch.distributed.run"]


def wait_for_run(run_dir: str | Path, timeout: float, *, exited: Callable[[], int | None] = lambda: None,
                 stderr: Callable[[], str] = lambda: ""):
    """The run's run.json, once rank 0 has written it; fails after `timeout` seconds, or
    at once when the launcher has exited (`exited()` gives its status), with its stderr."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return find_run(str(run_dir))
        except RunNotFound:
            status = exited()
            if time.monotonic() > deadline or status is not None:
                raise AssertionError(f"no run.json in {run_dir} within {timeout}s (exit {status})\n"
                                     f"{stderr()}") from None
            time.sleep(0.02)


def drain(subs: dict[int, Subscriber], timeout: float) -> dict[int, list]:
    """Every rank's events until its publisher has finished (final heartbeat)."""
    got: dict[int, list] = {rank: [] for rank in subs}
    deadline = time.monotonic() + timeout
    while not all(sub.finished for sub in subs.values()):
        open_ranks = [rank for rank, sub in subs.items() if not sub.finished]
        assert time.monotonic() < deadline, f"rank(s) {open_ranks} still publishing after {timeout}s"
        for rank, sub in subs.items():
            while not sub.finished and (msg := sub.recv(timeout=0.05)) is not None:
                got[rank].append(msg)
    return got
