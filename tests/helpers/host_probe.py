"""A monitor's callback for tests across hosts: it notes every batch_end it handles, one
JSON line each, and halts the run once the --trigger file exists (once), noting the ack."""

import json
import os
import time

from offloop.workers import Callback


class HostProbe(Callback):
    def __init__(self, path: str, trigger: str = "") -> None:
        self.path, self.trigger, self.halted = path, trigger, False

    def _note(self, **fields) -> None:
        with open(self.path, "a") as out:
            out.write(json.dumps({**fields, "t": time.time()}) + "\n")

    def fit_start(self, state, logger):
        self._note(fit_start=True)

    def batch_end(self, state, logger):
        self._note(step=state.timestamp.batch)
        if self.trigger and not self.halted and os.path.exists(self.trigger):
            self.halted = True
            ack = self.halt("monitor host, after the heal")
            self._note(ack={"ok": ack.ok, "step": ack.result.get("step"), "error": ack.error},
                       asked_at=state.timestamp.batch)

    def fit_end(self, state, logger):
        self._note(fit_end=True)

    def close(self, state, logger):
        self._note(closed=True, events=state.events_received, gaps=state.gaps)


class FloodProbe(HostProbe):
    """A HostProbe that also takes every per-batch event of the loop (a dozen a batch): with
    a short queue at the trainer, a partition overflows it."""

    state_topics = frozenset({
        "before_dataloader", "after_dataloader", "batch_start", "before_train_batch", "before_forward",
        "after_forward", "before_loss", "after_loss", "before_backward", "after_backward",
        "after_train_batch", "batch_checkpoint"})
