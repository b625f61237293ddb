"""Logger destinations on a real run: console, JSONL file, and TensorBoard event files,
each read back after a real Trainer and a real Worker have run an LRMonitor."""

from __future__ import annotations

import json

import pytest
from harness import run_with_worker

from offloop.workers import ConsoleLogger, JSONLLogger, TensorBoardLogger
from offloop.workers.callbacks import LRMonitor

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
    run_with_worker([LRMonitor()], tmp_path, max_duration="1ep", destinations=[TensorBoardLogger(log_dir)])
    events = EventAccumulator(str(log_dir))
    events.Reload()
    scalars = events.Scalars("lr-SGD/group0")
    assert [s.step for s in scalars] == list(range(1, BATCHES_PER_EPOCH + 1))
    assert all(s.value == pytest.approx(0.1) for s in scalars)
