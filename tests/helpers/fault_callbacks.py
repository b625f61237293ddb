"""Callbacks for the fault tests (tests/e2e/test_faults.py); importable by spawned workers."""

from __future__ import annotations

import json
import os

from offloop.workers import Callback


class PidStepLog(Callback):
    """Appends one JSON line per batch_end, at once: this process's pid, the batch, how many
    batch_ends this instance has handled, and what the State knew of the run."""

    def __init__(self, path: str) -> None:
        self.path, self.handled = path, 0

    def batch_end(self, state, logger) -> None:
        self.handled += 1
        line = json.dumps({"pid": os.getpid(), "step": state.timestamp.batch, "n": self.handled,
                           "run_name": state.run_name, "max_duration": str(state.max_duration),
                           "gaps": state.gaps})
        with open(self.path, "a") as out:
            out.write(line + "\n")


class StepList(Callback):
    """Keeps the batch of every batch_end it saw; writes them and its gap count on close."""

    def __init__(self, path: str) -> None:
        self.path, self.steps = path, []

    def batch_end(self, state, logger) -> None:
        self.steps.append(state.timestamp.batch)

    def close(self, state, logger) -> None:
        part = f"{self.path}.part"  # renamed once whole: a test reads the file as soon as it exists
        with open(part, "w") as out:
            json.dump({"steps": self.steps, "gaps": state.gaps, "pid": os.getpid()}, out)
        os.replace(part, self.path)


class Stuck(Callback):
    """Never returns from its third batch_end (a callback caught in a hung upload, say)."""

    def batch_end(self, state, logger) -> None:
        if state.timestamp.batch >= 3:
            import time

            while True:
                time.sleep(1)
