"""Callbacks the tests hand to Trainer(callbacks=[...]); importable by spawned workers."""

from __future__ import annotations

import json

from helpers.probes import thread_nice_values

from offloop.workers import Callback


class Recorder(Callback):
    """Writes every event it saw (topic and the five counters) to a JSON file on close."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.seen: list = []

    def run_event(self, event, state, logger) -> None:
        self.seen.append([str(event), list(state.timestamp.__dict__.values())])

    def close(self, state, logger) -> None:
        with open(self.path, "w") as out:
            json.dump(self.seen, out)


class Crasher(Callback):
    """Raises on every batch_end."""

    def batch_end(self, state, logger) -> None:
        raise RuntimeError("this callback always fails")


class BatchCounter(Callback):
    """Counts batch_end events and writes the count on close."""

    def __init__(self, path: str) -> None:
        self.path, self.count = path, 0

    def batch_end(self, state, logger) -> None:
        self.count += 1

    def close(self, state, logger) -> None:
        with open(self.path, "w") as out:
            json.dump({"batch_end": self.count}, out)


class NiceProbe(Callback):
    """Writes the CPU priority (nice value) of its worker process's threads on fit_end."""

    def __init__(self, path: str) -> None:
        self.path = path

    def fit_end(self, state, logger) -> None:
        import os

        with open(self.path, "w") as out:
            json.dump({"nice": os.nice(0), "threads": thread_nice_values()}, out)


class ExitOnSecondFit(Callback):
    """Its process exits outright (status 7) at the second fit_start it sees."""

    def __init__(self) -> None:
        self.fits = 0

    def fit_start(self, state, logger) -> None:
        import os

        self.fits += 1
        if self.fits == 2:
            os._exit(7)


class LossProbe(Callback):
    """Writes each after_loss and batch_end loss it saw, with the step, on close."""

    def __init__(self, path: str) -> None:
        self.path, self.seen = path, []

    def after_loss(self, state, logger) -> None:
        self.seen.append(["after_loss", state.timestamp.batch, state.loss])

    def batch_end(self, state, logger) -> None:
        self.seen.append(["batch_end", state.timestamp.batch, state.loss])

    def close(self, state, logger) -> None:
        with open(self.path, "w") as out:
            json.dump(self.seen, out)
