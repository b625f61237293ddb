"""Record a real run, then replay it offline through callbacks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers.harness import run_with_worker

from offloop.bus.recording import RecordingWriter, read_recording
from offloop.bus.wire import EventEncoder
from offloop.workers import Callback
from offloop.workers.callbacks import Recorder
from offloop.workers.replay import replay

ROOT = Path(__file__).parent.parent.parent


class Counter(Callback):
    def __init__(self):
        self.batch_ends = 0

    def batch_end(self, state, logger):
        self.batch_ends += 1


def test_recording_of_a_real_run_replays_every_event_through_the_cli(tmp_path):
    recorder = Recorder(str(tmp_path / "run.offloop"))
    trainer, worker = run_with_worker([recorder, Counter()], tmp_path, max_duration="2ep")
    header, records = read_recording(tmp_path / "run.offloop")
    events = [r for r in records if not isinstance(r, tuple)]
    assert header["run_name"] == "run" and header["config"]["max_duration"] == "2ep"
    assert len(events) == worker.stats.events  # every event the worker handled
    assert [m.ts[1] for m in events if m.topic == "batch_end"] == list(range(1, 17))

    report = tmp_path / "replayed.json"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
    proc = subprocess.run(
        [sys.executable, "-m", "offloop.cli", "replay", str(tmp_path / "run.offloop"),
         f"helpers.replay_probe:CountAndHalt({str(report)!r})", "--quiet"],
        env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(report.read_text())
    assert seen["batches"] == 16 and seen["last"] == 16 and seen["run_name"] == "run"
    assert "[replay] halt requested at batch 8" in proc.stdout  # printed, not sent
    assert "[replay] checkpoint requested at batch 8" in proc.stdout
    assert seen["acks"][0]["replayed"] is True
    assert "2 control requests printed (not sent)" in proc.stderr
    assert trainer.timestamp.batch == 16  # the real run was never touched


def test_gaps_are_recorded_where_they_happen_and_a_cut_short_recording_still_replays(tmp_path):
    enc = EventEncoder("r", "p", 0)
    path = tmp_path / "rec.offloop"
    writer = RecordingWriter(path, "r", "cut", {"max_duration": "9ba"})
    for batch in (1, 2):
        writer.event(enc.encode("batch_end", batch, batch, (0, batch, batch, 8 * batch, 0), {"loss": 1.0}))
    writer.gap("batch_end", 3)
    writer.event(enc.encode("batch_end", 6, 6, (0, 6, 6, 48, 0), {"loss": 0.5}))
    writer._file.flush()
    raw = path.read_bytes()
    path.write_bytes(raw + b"\x82\xa1k\xa2ev")  # a record cut in the middle, as by a crash
    counter = Counter()
    worker = replay(path, [counter], destinations=[])
    assert counter.batch_ends == 3 and worker.stats.gaps == 3
    assert worker.state.timestamp.batch == 6 and worker.state.loss == 0.5
    assert worker.truncated and worker.malformed == 0


def test_bad_records_are_counted_and_the_replay_goes_on_past_them(tmp_path):
    enc = EventEncoder("r", "p", 0)
    path = tmp_path / "rec.offloop"
    writer = RecordingWriter(path, "r", "bad", {"max_duration": "9ba"})
    writer.event(enc.encode("batch_end", 1, 1, (0, 1, 1, 8, 0), {"loss": 1.0}))
    writer._write({"k": "ev", "f": 7})  # frames that are not a list: a TypeError before
    writer._write({"k": "gap", "topic": "batch_end", "n": "three"})  # ended the replay quietly before
    writer._write({"k": "gap", "topic": "batch_end", "n": 2})
    writer._write(["not", "a", "record"])
    writer.event(enc.encode("batch_end", 4, 4, (0, 4, 4, 32, 0), {"loss": 0.5}))
    writer.close()
    counter = Counter()
    worker = replay(path, [counter], destinations=[])
    assert counter.batch_ends == 2 and worker.state.timestamp.batch == 4
    assert worker.malformed == 3 and worker.stats.gaps == 2 and not worker.truncated


def test_replay_refuses_a_file_that_is_not_a_recording(tmp_path):
    bogus = tmp_path / "x.offloop"
    bogus.write_bytes(b"not msgpack at all \xc1")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "offloop.cli", "replay", str(bogus), "Recorder"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "is not an offloop recording" in proc.stderr
