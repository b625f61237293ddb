"""Logger destinations on a real run: console, JSONL file, and TensorBoard event files,
each read back after a real Trainer and a real Worker have run an LRMonitor."""

from __future__ import annotations

import json

import pytest
from helpers.harness import run_with_worker

from offloop.bus import Message
from offloop.bus.discovery import RunInfo
from offloop.workers import (
    Callback,
    ConsoleLogger,
    JSONLLogger,
    LoggerDestination,
    TensorboardLogger,
)
from offloop.workers.callbacks import LRMonitor
from offloop.workers.runtime import CallbackRuntime

BATCHES_PER_EPOCH = 8  # the harness trains on 64 samples in batches of 8


def test_console_and_jsonl_get_one_record_per_logged_step(tmp_path, capsys):
    path = tmp_path / "logs" / "metrics.jsonl"
    run_with_worker([LRMonitor()], tmp_path, max_duration="2ep",
                    destinations=[ConsoleLogger(), JSONLLogger(path)])
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    steps = [line["step"] for line in lines if "lr-SGD/group0" in line]
    assert steps == list(range(1, 2 * BATCHES_PER_EPOCH + 1))
    assert all(line["lr-SGD/group0"] == pytest.approx(0.1) for line in lines if "step" in line)
    out = capsys.readouterr().out
    assert out.count("lr-SGD/group0: 0.1") == 2 * BATCHES_PER_EPOCH
    assert "[step 16] lr-SGD/group0: 0.1" in out


def test_tensorboard_event_files_hold_the_logged_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_dir = tmp_path / "tb"
    # as `offloop worker --tensorboard` writes: straight into log_dir, flushed at every step
    tensorboard = TensorboardLogger(log_dir, flush_interval=1, run_folder=False)
    run_with_worker([LRMonitor()], tmp_path, max_duration="1ep", destinations=[tensorboard])
    events = EventAccumulator(str(log_dir))
    events.Reload()
    scalars = events.Scalars("lr-SGD/group0")
    assert [s.step for s in scalars] == list(range(1, BATCHES_PER_EPOCH + 1))
    assert all(s.value == pytest.approx(0.1) for s in scalars)


class Logs(Callback):
    def __init__(self, *calls) -> None:
        self.calls = calls

    def batch_end(self, state, logger) -> None:
        for call in self.calls:
            if isinstance(call, str):
                logger.log_text(call)
            else:
                logger.log_metrics(call)


class Calls(LoggerDestination):
    def __init__(self) -> None:
        self.calls = []

    def log_metrics(self, metrics, step) -> None:
        self.calls.append((step, dict(metrics)))

    def log_text(self, text) -> None:
        self.calls.append(text)


def test_a_steps_metrics_reach_a_destination_in_one_call_and_none_is_lost():
    calls = Calls()
    worker = CallbackRuntime(RunInfo("r", "r", 0, 0.0, {"events": "tcp://127.0.0.1:1"}),
                             [Logs({"a": 1}, {"b": 2}), Logs({"a": 3}, "note", {"c": 4})],
                             destinations=[calls])
    for seq, batch in enumerate((1, 2)):
        worker.dispatch(Message("batch_end", "ev", "r", "p", 0, seq, seq, 1.0, (0, batch, batch, 8, 0), {}))
    assert worker.logger.wait(timeout=10)  # the destinations are called on a thread of their own
    assert calls.calls == [
        (1, {"a": 1, "b": 2}),  # two calls of one step: one
        (1, {"a": 3}), "note", (1, {"c": 4}),  # "a" again: sent apart; text keeps its place
        (2, {"a": 1, "b": 2}), (2, {"a": 3}), "note", (2, {"c": 4}),
    ]
