"""Callbacks used through `offloop replay` in the tests."""

import json

from offloop.workers import Callback


class CountAndHalt(Callback):
    """Counts batch_end events; asks for a halt and a checkpoint at the first epoch_end."""

    def __init__(self, path):
        self.path, self.batches, self.acks = path, 0, []

    def batch_end(self, state, logger):
        self.batches += 1

    def epoch_end(self, state, logger):
        if not self.acks:
            self.acks.append(self.halt("replayed stop").result)
            self.acks.append(self.request_checkpoint("x").result)

    def close(self, state, logger):
        with open(self.path, "w") as out:
            json.dump({"batches": self.batches, "acks": self.acks, "last": state.timestamp.batch,
                       "run_name": state.run_name}, out)
