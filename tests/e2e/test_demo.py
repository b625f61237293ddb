"""`offloop demo`: the README's first command, and its live recipe, end to end in real processes."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
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


# --------------------------------------------------- the README's live recipe, by hand

BIN = Path(sys.executable).parent  # the virtualenv's bin: `offloop` lives here, off PATH


def _env_without_the_venv_on_path() -> dict:
    """A fresh shell after `make demo`: .venv/bin is not on PATH, so a bare `offloop` fails."""
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep)
            if p and Path(p).resolve() != BIN.resolve()]
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "OFFLOOP_RUNS", "PYTHONPATH")}
    return {**env, "PATH": os.pathsep.join(path or ["/usr/bin", "/bin"])}


class Lines:
    """A child's stdout, read a line at a time, each wait bounded."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.buffer, self.seen = proc, b"", []

    def until(self, predicate, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" in self.buffer:
                raw, self.buffer = self.buffer.split(b"\n", 1)
                line = raw.decode()
                self.seen.append(line)
                if predicate(line):
                    return line
            left = deadline - time.monotonic()
            assert left > 0, "no such line within the deadline; so far:\n" + "\n".join(self.seen[-30:])
            if select.select([self.proc.stdout], [], [], left)[0]:
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                assert chunk, f"demo exited ({self.proc.wait()}); so far:\n" + "\n".join(self.seen[-30:])
                self.buffer += chunk


def _shell(line: str, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    """Run a printed command as a person pastes it (comment and all) into a shell."""
    return subprocess.run(["bash", "-c", line], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL)


def test_a_slowed_demo_can_be_steered_by_hand_with_the_commands_it_prints(tmp_path):
    env = _env_without_the_venv_on_path()
    assert _shell("command -v offloop", env, tmp_path).returncode != 0  # bare `offloop` is not found
    delay = 0.05
    started = time.monotonic()
    errors = (tmp_path / "demo.err").open("wb")  # a file, not a pipe nobody reads until the end
    demo = subprocess.Popen([str(BIN / "offloop"), "demo", "--step-delay", str(delay),
                             "--max-duration", "100ep", "--patience", "1000"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=errors,
                            stdin=subprocess.DEVNULL)
    try:
        out = Lines(demo)
        out.until(lambda line: "from another terminal" in line)
        hints = {line.split()[1]: line.strip() for line in (out.until(lambda _: True) for _ in range(3))}
        assert set(hints) == {"attach", "checkpoint", "halt"}, hints
        run_dir = Path(hints["halt"].split()[2])
        assert run_dir.parent == tmp_path / "runs"  # the default runs root, where `offloop ls` looks

        checkpoint = _shell(hints["checkpoint"], env, tmp_path)
        assert checkpoint.returncode == 0, checkpoint.stderr
        assert Path(checkpoint.stdout.strip().rsplit(": ", 1)[1]).exists()
        halt = _shell(hints["halt"], env, tmp_path)
        assert halt.returncode == 0, halt.stderr  # still running: a person had the time
        step = int(halt.stdout.split("after batch ")[1].split()[0])
        assert step * delay <= time.monotonic() - started  # every batch took the delay at least

        replay_hint = out.until(lambda line: line.strip().startswith("recording "))
        assert demo.wait(timeout=120) == 0, (tmp_path / "demo.err").read_text()[-3000:]
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait(timeout=30)
        errors.close()
    assert "stopped by    cli-" in "\n".join(out.seen)
    recording = replay_hint.split()[1]
    assert recording == str(run_dir / "recording.offloop") and Path(recording).stat().st_size > 0
    replay = _shell(replay_hint.split("(try: ", 1)[1].rstrip(")"), env, tmp_path)
    assert replay.returncode == 0, replay.stderr
    assert f"[step {step}] lr-" in replay.stdout + replay.stderr  # LRMonitor saw the run through to the halt

    # once .venv/bin is on PATH (README: `. .venv/bin/activate`), the hints say plain `offloop`
    on_path = {**env, "PATH": f"{BIN}{os.pathsep}{env['PATH']}"}
    said = subprocess.run([sys.executable, "-c", "from offloop.commands.shell import command; "
                           "print(command('attach', 'runs/x y'))"], env=on_path, capture_output=True,
                          text=True, timeout=60)
    assert said.stdout.strip() == "offloop attach 'runs/x y'", said.stderr


def test_demo_without_scikit_learn_names_the_extra_to_install(tmp_path):
    shadow = tmp_path / "no-sklearn" / "sklearn"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(  # what importing it does where it is not installed
        "raise ModuleNotFoundError(\"No module named 'sklearn'\", name='sklearn')\n")
    env = {**_env_without_the_venv_on_path(), "PYTHONPATH": str(shadow.parent)}
    proc = subprocess.run([str(BIN / "offloop"), "demo"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        "offloop: error: offloop demo needs scikit-learn for its dataset, which is not installed: "
        "pip install 'offloop[demo]' (or `make demo` in a clone)"]
    assert not (tmp_path / "runs").exists()
