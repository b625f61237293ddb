"""`offloop demo`: the README's first command, end to end in real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent.parent


def test_demo_trains_stops_early_checkpoints_and_exits_zero(tmp_path):
    run_dir = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "offloop.cli", "demo", "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "stopped by    EarlyStopper" in out  # halted over the control channel
    accuracy = float(out.split("eval accuracy ")[1].split()[0])
    assert accuracy > 0.9
    checkpoints = sorted((run_dir / "checkpoints").glob("*.pt"))
    assert 1 <= len(checkpoints) <= 2 and (run_dir / "checkpoints" / "latest").exists()
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("MulticlassAccuracy" in line for line in lines)
    assert (run_dir / "recording.offloop").stat().st_size > 0
    info = json.loads((run_dir / "run.json").read_text())
    assert info["finished"] and info["extra"]["stopped_by"]["reason"].startswith("EarlyStopper")
    assert str(run_dir) in out and "metrics log" in out


def test_demo_honours_max_duration(tmp_path):
    run_dir = tmp_path / "short"
    proc = subprocess.run([sys.executable, "-m", "offloop.cli", "demo", "--run-dir", str(run_dir),
                           "--max-duration", "3ep"],
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads((run_dir / "run.json").read_text())
    assert info["finished"] and info["extra"]["progress"]["epoch"] == 3
    assert info["extra"]["stopped_by"] is None  # max_duration ended it, not the stopper
