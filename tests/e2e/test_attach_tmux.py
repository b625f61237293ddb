"""`offloop attach` in a real terminal: tmux runs it, capture-pane reads the screen."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from helpers.waiting import wait_for_file

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
        return out.stdout if out.returncode == 0 else f"(capture-pane failed: {out.stderr.strip()})"

    def wait_for(self, pattern: str, timeout: float = 30) -> re.Match:
        deadline, last = time.monotonic() + timeout, ""
        while True:
            screen = self.screen()
            match = re.search(pattern, screen)
            if match:
                return match
            last = last if screen.startswith("(capture-pane failed") else screen
            if time.monotonic() > deadline:  # the last screen read, even if the pane has gone since
                raise AssertionError(f"screen never showed {pattern!r}:\n{self.screen()}\nlast screen read:\n{last}")
            time.sleep(0.1)

    def type(self, text: str) -> None:
        """Type `text` and press Enter, as a person at the terminal would."""
        subprocess.run([*self.args, "send-keys", "-t", "t", "-l", text], check=True, timeout=10)
        subprocess.run([*self.args, "send-keys", "-t", "t", "Enter"], check=True, timeout=10)

    def kill(self) -> None:
        subprocess.run([*self.args, "kill-server"], capture_output=True, timeout=10)


@pytest.fixture
def tmux():
    # a server of its own per test: reusing one name, a test could start its session on the
    # server the test before it was still killing (seen once in CI: an empty screen)
    session = Tmux(f"offloop-test-{os.getpid()}-{uuid.uuid4().hex[:8]}")
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
    tmux.wait_for(r"ETA \d+:\d\d:\d\d")

    halt = subprocess.run([sys.executable, "-m", "offloop.cli", "halt", str(run_dir), "--reason", "seen enough"],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert halt.returncode == 0, halt.stderr
    tmux.wait_for(r"control\s+1 requests, last: halt from cli-")
    tmux.wait_for(r"finished \(halted: seen enough\)")
    tmux.wait_for(r"ATTACH-EXITED 0")
    assert "ETA" not in tmux.screen()  # the run has ended: no time left to estimate
    assert trainer.line(timeout=30)["done"] < 3000


def test_attach_with_no_run_asks_which_of_several_live_runs(spawn, tmp_path, tmux):
    root = tmp_path / "runs"
    for name in ("first", "second"):
        spawn("slow_trainer", root / name, 3000, 0.02).line()
        wait_for_file(root / name / "run.json", 30, interval=0.05)
    attach = (f"cd {shlex.quote(str(tmp_path))} && PYTHONPATH={shlex.quote(str(ROOT))} "
              f"{shlex.quote(sys.executable)} -m offloop.cli attach; "  # ./runs, the default root
              "echo ATTACH-EXITED $?; sleep 60")
    tmux.start(attach)
    tmux.wait_for(rf"2 live runs under {re.escape(str(root))}:")
    tmux.wait_for(r"1\. first  \(started [-\d]+ [:\d]+\)\n\s+2\. second  \(started ")
    tmux.wait_for(r"attach to which\? \[1-2, or a name\]")
    tmux.type("3")
    tmux.wait_for(r"'3' is none of them")
    tmux.type("2")
    tmux.wait_for(r"run\s+second\s+running")
    tmux.wait_for(r"batch \d+/3000")
    halt = subprocess.run([sys.executable, "-m", "offloop.cli", "halt", str(root / "second")],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert halt.returncode == 0, halt.stderr
    tmux.wait_for(r"ATTACH-EXITED 0")
    assert "offloop attach: run second finished" in tmux.screen()
