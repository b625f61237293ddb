"""The harness itself: a worker in the test process sees the run's events in order."""

from __future__ import annotations

from helpers.harness import MemoryLog, run_with_worker

from offloop.workers import Callback


class EpochPrinter(Callback):
    def __init__(self):
        self.epochs = []

    def epoch_start(self, state, logger):
        self.epochs.append(state.timestamp.epoch)
        logger.log_metrics({"epoch": state.timestamp.epoch})


def test_worker_in_thread_sees_each_epoch(tmp_path):
    log = MemoryLog()
    callback = EpochPrinter()
    trainer, worker = run_with_worker([callback], tmp_path, destinations=[log])
    assert callback.epochs == [0, 1, 2]
    assert log.values("epoch") == [0, 1, 2]
    assert worker.stats.events > 0 and worker.stats.gaps == 0
