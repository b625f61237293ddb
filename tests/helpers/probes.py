"""Callbacks that report what a worker process saw, by writing JSON on close."""

import json
import os

from offloop.workers import Callback


def thread_nice_values() -> list[int]:
    """The nice value of every thread of this process (Linux keeps one per thread)."""
    return [os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir("/proc/self/task")]


class JoinProbe(Callback):
    """Records what the State knew at the first event it handled, and how many it handled."""

    def __init__(self, path):
        self.path, self.first, self.count, self.closed_at = path, None, 0, None

    def batch_end(self, state, logger):
        if self.first is None:
            open(self.path + ".first", "w").close()  # tells a test this worker is handling events
            self.first = {"batch": state.timestamp.batch, "run_name": state.run_name,
                          "max_duration": str(state.max_duration), "loss": state.loss,
                          "nice": sorted(set(thread_nice_values()))}
        self.count += 1

    def close(self, state, logger):
        with open(self.path, "w") as out:
            json.dump({"first": self.first, "count": self.count,
                       "last_batch": state.timestamp.batch}, out)
