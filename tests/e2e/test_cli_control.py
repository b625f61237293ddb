"""`offloop halt`, `checkpoint`, `ls`, `attach`, `replay` against real runs in other processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from helpers.waiting import wait_for_file

ROOT = Path(__file__).parent.parent.parent
TESTS = ROOT / "tests"


def offloop(*args: str, timeout: float = 60, cwd: Path | None = None,
            pythonpath: str = "") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OFFLOOP_RUNS"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), str(TESTS), pythonpath) if p)
    return subprocess.run([sys.executable, "-m", "offloop.cli", *args], env=env, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL, cwd=cwd)


def test_checkpoint_then_halt_a_live_run_then_ls_shows_it_finished(spawn, tmp_path):
    run_dir = tmp_path / "runs" / "job"
    trainer = spawn("slow_trainer", run_dir, 2000, 0.02)
    trainer.line()
    wait_for_file(run_dir / "run.json")

    listed = offloop("ls", "--runs-root", str(tmp_path / "runs"), "--json")
    row = json.loads(listed.stdout.splitlines()[0])
    assert row["name"] == "job" and row["status"] == "live"

    ckpt = offloop("checkpoint", "job", "--runs-root", str(tmp_path / "runs"), "--tag", "cli")
    assert ckpt.returncode == 0, ckpt.stderr
    assert "checkpoint of run job at batch" in ckpt.stdout
    path = Path(ckpt.stdout.strip().rsplit(": ", 1)[1])
    assert path.exists() and path.name.endswith("-cli.pt")
    second = offloop("checkpoint", "job", "--runs-root", str(tmp_path / "runs"))
    assert second.returncode == 0, second.stderr

    # a monitor attached now gets only the latest of each topic, yet shows the totals
    screen = offloop("attach", str(run_dir), "--once")
    assert screen.returncode == 0, screen.stderr
    assert "checkpoints  2, last" in screen.stdout and "control      2 requests" in screen.stdout, screen.stdout
    assert "batches/s" in screen.stdout and "ETA ?" not in screen.stdout, screen.stdout

    halt = offloop("halt", str(run_dir), "--reason", "from the test")
    assert halt.returncode == 0, halt.stderr
    step = int(halt.stdout.split("after batch ")[1].split()[0])
    assert trainer.line(timeout=60)["done"] == step

    trainer.wait(timeout=30)
    listed = offloop("ls", "--runs-root", str(tmp_path / "runs"))
    assert "job" in listed.stdout and "finished" in listed.stdout and f"ba {step}" in listed.stdout

    again = offloop("halt", str(run_dir))
    assert again.returncode == 1 and "has finished" in again.stderr


def test_a_refused_checkpoint_exits_non_zero_naming_why_and_the_run_goes_on(spawn, tmp_path):
    run_dir = tmp_path / "runs" / "job"
    trainer = spawn("slow_trainer", run_dir, 2000, 0.02)
    trainer.line()
    wait_for_file(run_dir / "run.json")
    (run_dir / "checkpoints").write_text("a file where the checkpoint folder should be")
    refused = offloop("checkpoint", str(run_dir), "--tag", "nope")
    assert refused.returncode == 1, refused.stdout
    assert "run job refused the checkpoint: cannot write a checkpoint in" in refused.stderr, refused.stderr
    halt = offloop("halt", str(run_dir))  # still training: the refusal cost it nothing
    assert halt.returncode == 0, halt.stderr
    trainer.wait(timeout=30)


def test_halt_of_unknown_or_dead_runs_fails_clearly(tmp_path, free_port):
    unknown = offloop("halt", "nope", "--runs-root", str(tmp_path))
    assert unknown.returncode == 1 and "no run 'nope'" in unknown.stderr

    from offloop.bus import RunInfo, write_run_info

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    write_run_info(tmp_path / "ghost", RunInfo("g", "ghost", dead.pid, time.time(),
                                               {"control": f"tcp://127.0.0.1:{free_port}"}))
    ghost = offloop("halt", "ghost", "--runs-root", str(tmp_path))
    assert ghost.returncode == 1 and "is not running" in ghost.stderr

    unreachable = offloop("halt", f"tcp://127.0.0.1:{free_port}")
    assert unreachable.returncode == 1 and "no run answered" in unreachable.stderr


def test_halt_that_gets_no_answer_times_out(tmp_path, free_port):
    from offloop.bus import RunInfo, write_run_info

    # a live process (this one) whose run has a control endpoint nobody serves
    write_run_info(tmp_path / "mute", RunInfo("m", "mute", os.getpid(), time.time(),
                                              {"control": f"tcp://127.0.0.1:{free_port}"}))
    mute = offloop("halt", "mute", "--runs-root", str(tmp_path), "--timeout", "1")
    assert mute.returncode == 1 and "did not answer" in mute.stderr


def test_ls_names_the_runs_root_it_looked_in_as_an_absolute_path(tmp_path):
    empty = offloop("ls", cwd=tmp_path)  # no --runs-root, no $OFFLOOP_RUNS: ./runs
    assert empty.returncode == 0 and empty.stdout.strip() == f"no runs under {tmp_path / 'runs'}", empty.stdout

    from offloop.bus import RunInfo, write_run_info

    write_run_info(tmp_path / "elsewhere" / "old", RunInfo("o", "old", os.getpid(), time.time(), {},
                                                           finished=True))
    listed = offloop("ls", "--runs-root", "elsewhere", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines()[0] == f"runs under {tmp_path / 'elsewhere'}:", listed.stdout
    as_json = offloop("ls", "--runs-root", "elsewhere", "--json", cwd=tmp_path)
    assert json.loads(as_json.stdout.splitlines()[0])["name"] == "old"  # JSON lines stay JSON


def test_attach_with_no_run_picks_the_one_live_run_and_names_them_when_there_are_several(spawn, tmp_path):
    root = tmp_path / "runs"
    none = offloop("attach", "--runs-root", str(root), "--once")
    assert none.returncode == 1 and f"no live run under {root} to attach to" in none.stderr, none.stderr

    from offloop.bus import RunInfo, write_run_info

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # an unfinished run whose process is gone is not live: never picked
    write_run_info(root / "ghost", RunInfo("g", "ghost", dead.pid, time.time(), {}))
    first = spawn("slow_trainer", root / "first", 3000, 0.02)
    first.line()
    wait_for_file(root / "first" / "run.json")
    one = offloop("attach", "--runs-root", str(root), "--once")
    assert one.returncode == 0, one.stderr
    assert "run       first  running" in one.stdout, one.stdout

    second = spawn("slow_trainer", root / "second", 3000, 0.02)
    second.line()
    wait_for_file(root / "second" / "run.json")
    several = offloop("attach", "--runs-root", str(root), timeout=20)  # stdin is not a terminal
    assert several.returncode == 1, several.stdout
    assert several.stderr.startswith(f"offloop: error: 2 live runs under {root}: first, second; "
                                     "name the one to attach to"), several.stderr
    assert len(several.stderr.strip().splitlines()) == 1 and several.stdout == ""
    for run in ("first", "second"):
        assert offloop("halt", run, "--runs-root", str(root)).returncode == 0


def test_replay_exits_non_zero_when_a_callback_raised(tmp_path):
    from offloop.bus.recording import RecordingWriter
    from offloop.bus.wire import EventEncoder

    enc = EventEncoder("r", "p", 0)
    recording = tmp_path / "run.offloop"
    writer = RecordingWriter(recording, "r", "run", {"max_duration": "3ba"})
    for batch in (1, 2, 3):
        writer.event(enc.encode("batch_end", batch, batch, (0, batch, batch, 8 * batch, 0), {"loss": 1.0}))
    writer.close()
    (tmp_path / "mycallbacks.py").write_text(
        "from offloop.workers import Callback\n"
        "class Fine(Callback):\n"
        "    def batch_end(self, state, logger):\n"
        "        pass\n"
        "class Broken(Callback):\n"
        "    def batch_end(self, state, logger):\n"
        "        if state.timestamp.batch == 2:\n"
        "            raise RuntimeError('the bug being looked for')\n")

    fine = offloop("replay", str(recording), "mycallbacks:Fine()", "--quiet", pythonpath=str(tmp_path))
    assert fine.returncode == 0, fine.stderr
    broken = offloop("replay", str(recording), "mycallbacks:Fine()", "mycallbacks:Broken()", "--quiet",
                     pythonpath=str(tmp_path))
    assert broken.returncode == 1, broken.stderr
    assert "RuntimeError: the bug being looked for" in broken.stderr  # the traceback, for the author
    assert "3 events replayed" in broken.stderr and "1 callback errors" in broken.stderr
    assert broken.stderr.strip().splitlines()[-1] == (
        "offloop: error: 1 callback error during the replay (each traceback is above)")


def test_concurrent_checkpoint_commands_each_get_their_own_file(spawn, tmp_path):
    # batches of 1.5 s: the two commands, started together, are read at the same batch
    run_dir = tmp_path / "runs" / "job"
    trainer = spawn("slow_trainer", run_dir, 40, 1.5)
    trainer.line()
    wait_for_file(run_dir / "run.json")
    env = {k: v for k, v in os.environ.items() if k != "OFFLOOP_RUNS"}
    env["PYTHONPATH"] = os.pathsep.join((str(ROOT), str(TESTS)))
    commands = [subprocess.Popen([sys.executable, "-m", "offloop.cli", "checkpoint", str(run_dir), "--tag", tag],
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 stdin=subprocess.DEVNULL) for tag in ("a", "b")]
    outs = [command.communicate(timeout=60) for command in commands]
    assert all(command.returncode == 0 for command in commands), outs
    paths = [Path(out.strip().rsplit(": ", 1)[1]) for out, _ in outs]
    steps = [int(out.split("at batch ")[1].split()[0].rstrip(":")) for out, _ in outs]
    assert paths[0] != paths[1] and all(path.is_file() for path in paths)
    assert paths[0].name.endswith("-a.pt") and paths[1].name.endswith("-b.pt")  # each its own tag only
    assert steps[0] == steps[1], f"read at batches {steps}: not one batch"
    halt = offloop("halt", str(run_dir))
    assert halt.returncode == 0, halt.stderr
    trainer.wait(timeout=30)
