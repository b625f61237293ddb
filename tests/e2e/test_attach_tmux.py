"""`offloop attach` in a real terminal: tmux runs it, capture-pane reads the screen."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent.parent


class Tmux:
    """A private tmux server (its own socket) holding one pane."""

    def __init__(self, name: str) -> None:
        self.args = ["tmux", "-L", name]

    def start(self, command: str, width: int = 100, height: int = 30) -> None:
        subprocess.run([*self.args, "new-session", "-d", "-s", "t", "-x", str(width), "-y", str(height),
                        command], check=True, timeout=10)

    def screen(self) -> str:
        out = subprocess.run([*self.args, "capture-pane", "-p", "-t", "t"], capture_output=True,
                             text=True, timeout=10)
        return out.stdout

    def wait_for(self, pattern: str, timeout: float = 30) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            match = re.search(pattern, self.screen())
            if match:
                return match
            if time.monotonic() > deadline:
                raise AssertionError(f"screen never showed {pattern!r}:\n{self.screen()}")
            time.sleep(0.1)

    def kill(self) -> None:
        subprocess.run([*self.args, "kill-server"], capture_output=True, timeout=10)


@pytest.fixture
def tmux():
    session = Tmux(f"offloop-test-{os.getpid()}")
    yield session
    session.kill()


def test_attach_shows_a_running_job_live_and_exits_when_it_ends(spawn, tmp_path, tmux):
    run_dir = tmp_path / "job"
    trainer = spawn("slow_trainer", run_dir, 3000, 0.01)
    trainer.line()
    deadline = time.monotonic() + 30
    while not (run_dir / "run.json").exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    attach = (f"cd {shlex.quote(str(ROOT))} && PYTHONPATH={shlex.quote(str(ROOT))} "
              f"{shlex.quote(sys.executable)} -m offloop.cli attach {shlex.quote(str(run_dir))} --refresh 8; "
              "echo ATTACH-EXITED $?; sleep 60")
    tmux.start(attach)
    tmux.wait_for(r"run\s+job\s+running")
    tmux.wait_for(r"Linear \(18 params\) on cpu")
    first = int(tmux.wait_for(r"batch (\d+)/3000").group(1))
    tmux.wait_for(r"loss\s+\d+\.\d{4}")
    later = int(tmux.wait_for(rf"batch (?!{first}/)(\d+)/3000").group(1))
    assert later > first  # the screen follows the run
    tmux.wait_for(r"throughput\s+[\d.]+ batches/s")

    halt = subprocess.run([sys.executable, "-m", "offloop.cli", "halt", str(run_dir), "--reason", "seen enough"],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert halt.returncode == 0, halt.stderr
    tmux.wait_for(r"control\s+1 requests, last: halt from cli-")
    tmux.wait_for(r"finished \(halted: seen enough\)")
    tmux.wait_for(r"ATTACH-EXITED 0")
    assert trainer.line(timeout=30)["done"] < 3000
