"""torchrun support, proved with 2 real processes (`torchrun --nproc_per_node=2`, gloo, CPU).

Every rank publishes with its rank; rank 0 owns the control channel; a halt and a
checkpoint take effect on both ranks at the same step; the checkpoint is written once,
by rank 0, and a 2-rank run resumed from it ends bit for bit where an uninterrupted
2-rank run ends. A SIGTERM that reaches one rank alone stops both ranks at one step,
with one checkpoint.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from common import ask
from helpers.ranks import drain, torchrun_command, wait_for_run
from programs.ddp_train import weights_digest  # the digest the ranks print

from offloop.bus import Subscriber, find_run

ROOT = Path(__file__).resolve().parents[2]
HELPER = ROOT / "tests" / "programs" / "ddp_train.py"
BLOCK_AT = 10  # rank 0 is held before loading batch 10: epoch 1, 2 batches in (8 per epoch)
STEP = BLOCK_AT + 1  # requests queued while batch 10 loads are applied after it
DURATION = "3ep"  # 24 batches
TOPICS = ["batch_end", "control_request", "checkpoint_saved", "fit_end"]


class Torchrun:
    """`torchrun --standalone --nproc_per_node=2 ddp_train.py ...`; JSON lines from both ranks."""

    def __init__(self, tmp: Path, name: str, *args: str) -> None:
        self.run_dir = tmp / name
        self.stderr_path = tmp / f"{name}.stderr"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OFFLOOP_RUNS": str(tmp)}
        cmd = [*torchrun_command(), "--standalone", "--nproc_per_node=2", str(HELPER),
               "--run-dir", str(self.run_dir), *args]
        with open(self.stderr_path, "wb") as err:
            self.popen = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err,
                                          stdin=subprocess.DEVNULL, env=env, cwd=ROOT,
                                          start_new_session=True)
        self.lines: list[dict] = []
        self._buffer = b""
        self._eof = False

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")[-4000:]

    def _read(self, deadline: float) -> bool:
        """Read what stdout has until `deadline`; False at end of file or deadline."""
        left = deadline - time.monotonic()
        if self._eof or left <= 0:
            return False
        ready, _, _ = select.select([self.popen.stdout], [], [], left)
        if not ready:
            return False
        chunk = os.read(self.popen.stdout.fileno(), 65536)
        if not chunk:
            self._eof = True
            return False
        self._buffer += chunk
        *whole, self._buffer = self._buffer.split(b"\n")
        for raw in whole:
            try:
                line = json.loads(raw)
            except ValueError:
                continue  # not one of the helper's lines
            if isinstance(line, dict):
                self.lines.append(line)
        return True

    def wait_line(self, match, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            found = next((line for line in self.lines if match(line)), None)
            if found is not None:
                return found
            if not self._read(deadline):
                raise AssertionError(f"no such line from torchrun within {timeout}s (exit "
                                     f"{self.popen.poll()}); lines: {self.lines}\n{self.stderr()}")

    def finish(self, timeout: float = 60.0) -> int:
        """Exit status; fails (and kills every rank) if torchrun has not exited in time."""
        deadline = time.monotonic() + timeout
        while self._read(deadline):
            pass
        try:
            return self.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"torchrun did not exit within {timeout}s: a rank hung\n"
                                 f"{self.stderr()}") from None

    def finals(self) -> dict[int, dict]:
        return {line["rank"]: line for line in self.lines if line.get("final")}

    def kill(self) -> None:
        """Kill torchrun and the ranks it started (each rank runs in a session of its own)."""
        if self.popen.poll() is not None:
            return
        ranks = children(self.popen.pid)
        os.killpg(self.popen.pid, signal.SIGKILL)
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.popen.wait(timeout=10)


def children(pid: int) -> list[int]:
    """The child processes of `pid`, from /proc (empty where there is no /proc)."""
    found: list[int] = []
    for path in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            found += [int(child) for child in path.read_text().split()]
        except OSError:
            continue
    return found


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    started: list[Torchrun] = []
    tmp = tmp_path_factory.mktemp("torchrun")

    def start(name: str, *args: str) -> Torchrun:
        run = Torchrun(tmp, name, *args)
        started.append(run)
        return run

    yield start
    for run in started:
        run.kill()
        run.popen.stdout.close()


@pytest.fixture(scope="module")
def reference(launch):
    """An uninterrupted 2-rank run, started up front: it trains while the others start."""
    return launch("reference", "--max-duration", DURATION)


@pytest.fixture(scope="module")
def sigterm_run(launch, tmp_path_factory):
    """A 2-rank run held before batch BLOCK_AT until its gate file exists; started up
    front (by `halted`) so that its start-up overlaps the other runs'."""
    gate = tmp_path_factory.mktemp("gate") / "open"
    run = launch("sigterm", "--max-duration", DURATION, "--block-at", str(BLOCK_AT),
                 "--gate-file", str(gate), "--gate-timeout", "240")
    return run, gate


@pytest.fixture(scope="module")
def halted(launch, reference, sigterm_run):
    """A 2-rank run, halted and checkpointed from outside at step STEP."""
    run = launch("halted", "--max-duration", DURATION, "--block-at", str(BLOCK_AT),
                 "--wait-requests", "2")
    info = wait_for_run(run.run_dir, 30.0, exited=run.popen.poll, stderr=run.stderr)
    run.wait_line(lambda line: line.get("blocked") == BLOCK_AT)
    subs = {rank: Subscriber(eps["events"], eps["state"], topics=TOPICS)
            for rank, eps in enumerate(info.ranks)}
    for sub in subs.values():
        sub.connect(join_timeout=10)
    acks: dict = {}
    threads = [ask(info.endpoints["control"], "checkpoint", {"tag": "resume"}, acks),
               ask(info.endpoints["control"], "halt", {"reason": "test"}, acks)]
    try:
        events = drain(subs, 30.0)
    finally:
        for sub in subs.values():
            sub.close()
    rc = run.finish()
    for thread in threads:  # acks come before the ranks exit; none will come after a crash
        thread.join(30 if rc == 0 else 1)
    return {"run": run, "info": info, "acks": acks, "events": events, "rc": rc,
            "finals": run.finals()}


def test_two_ranks_publish_and_halt_and_checkpoint_at_one_step(halted):
    run, info, acks, events = halted["run"], halted["info"], halted["acks"], halted["events"]
    assert halted["rc"] == 0, run.stderr()  # no rank was left waiting in a collective
    # run.json: both ranks' endpoints; the control channel is rank 0's alone
    assert info.world_size == 2 and info.extra["config"]["world_size"] == 2
    assert len(info.ranks) == 2 and info.ranks[0]["events"] == info.endpoints["events"]
    assert len({eps["events"] for eps in info.ranks}) == 2 and "control" not in info.ranks[1]
    assert "control" in info.endpoints
    # each rank publishes on its own endpoint, every message with its rank
    for rank in (0, 1):
        assert events[rank] and {msg.rank for msg in events[rank]} == {rank}
        fit_end = [msg for msg in events[rank] if msg.topic == "fit_end"]
        assert len(fit_end) == 1 and fit_end[0].ts[1] == STEP
        saved = [msg for msg in events[rank] if msg.topic == "checkpoint_saved"]
        assert [(msg.ts[1], msg.data["step"]) for msg in saved] == [(STEP, STEP)]
        assert saved[0].data["tag"] == "resume"  # rank 1 holds no request: it has rank 0's tag
    assert any(msg.topic == "control_request" for msg in events[0])
    assert not any(msg.topic == "control_request" for msg in events[1])

    # the halt and the checkpoint were applied at the same step on both ranks
    halt, ckpt = acks["halt"], acks["checkpoint"]
    assert halt.ok and halt.result["step"] == STEP
    assert ckpt.ok and ckpt.result["step"] == STEP
    finals = halted["finals"]
    assert sorted(finals) == [0, 1], run.lines
    assert [(f["epoch"], f["batch"], f["batch_in_epoch"]) for f in finals.values()] == [(1, STEP, 3)] * 2
    assert finals[0]["weights"] == finals[1]["weights"]
    assert finals[0]["exit"] is None and finals[1]["exit"] is None
    assert finals[0]["stopped_by"]["reason"] == "test"

    # written once, by rank 0: one file, named in the ack, holding every rank's RNG
    path = Path(ckpt.result["path"])
    assert path.is_file() and path.parent.resolve() == (run.run_dir / "checkpoints").resolve()
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]
    assert finals[0]["checkpoints"] == [str(path)] and finals[1]["checkpoints"] == []
    assert all(msg.data["path"] == str(path) for rank in (0, 1)
               for msg in events[rank] if msg.topic == "checkpoint_saved")
    state = torch.load(path, map_location="cpu", weights_only=True)
    assert state["timestamp"]["batch"] == STEP and len(state["rng"]) == len(state["epoch_rng"]) == 2
    assert weights_digest(state["model"]) == finals[0]["weights"]


def test_checkpoint_resumes_on_two_ranks_bit_for_bit(halted, reference, launch):
    assert halted["rc"] == 0
    path = halted["acks"]["checkpoint"].result["path"]
    resumed = launch("resumed", "--max-duration", DURATION, "--load-path", path)
    assert resumed.finish() == 0, resumed.stderr()
    assert reference.finish() == 0, reference.stderr()

    starts = [line["resumed_at"] for line in resumed.lines if "started" in line]
    assert starts == [STEP, STEP]
    got, want = resumed.finals(), reference.finals()
    assert sorted(got) == sorted(want) == [0, 1], (resumed.lines, reference.lines)
    assert all(f["batch"] == 24 and f["epoch"] == 3 for f in [*got.values(), *want.values()])
    assert want[0]["weights"] == want[1]["weights"]
    assert halted["finals"][0]["weights"] != want[0]["weights"]  # the halt really cut training short
    assert got[0]["weights"] == got[1]["weights"] == want[0]["weights"], \
        "the resumed run's weights differ from the uninterrupted run's"
    assert find_run(str(resumed.run_dir)).world_size == 2
    assert not (resumed.run_dir / "checkpoints").exists()  # resuming writes nothing


def signal_taken(pid: int, timeout: float = 10.0) -> None:
    """Wait until `pid` has no signal pending: its handler has been entered (/proc)."""
    status = Path(f"/proc/{pid}/status")
    deadline = time.monotonic() + timeout
    while status.exists():
        fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
        if int(fields["SigPnd"], 16) == 0 and int(fields["ShdPnd"], 16) == 0:
            return
        assert time.monotonic() < deadline, f"process {pid} never took its signal"
        time.sleep(0.002)


def test_sigterm_to_one_rank_stops_both_at_one_step_with_one_checkpoint(sigterm_run):
    run, gate = sigterm_run
    rank1 = run.wait_line(lambda line: line.get("started") == 1)["pid"]
    run.wait_line(lambda line: line.get("blocked") == BLOCK_AT)
    # rank 1 cannot finish batch 10 before rank 0, held, has loaded it: the signal is taken
    # before the agreement at step 11, and only rank 1 has it
    os.kill(rank1, signal.SIGTERM)
    signal_taken(rank1)
    gate.touch()
    run.finish()  # rank 1 exits 128+SIGTERM, so torchrun reports a failure; none may hang
    finals = run.finals()
    assert sorted(finals) == [0, 1], (run.lines, run.stderr())
    assert [(f["epoch"], f["batch"]) for f in finals.values()] == [(1, STEP)] * 2, run.stderr()
    assert finals[0]["weights"] == finals[1]["weights"]
    assert finals[0]["exit"] is None and finals[1]["exit"] == f"SystemExit({128 + signal.SIGTERM})"
    assert finals[1]["stopped_by"]["reason"] == "SIGTERM"
    folder = run.run_dir / "checkpoints"
    files = sorted(folder.iterdir()) if folder.is_dir() else []
    assert [p.name for p in files] == [f"ep1-ba{STEP}-sigterm.pt"], run.stderr()
    assert [Path(p).resolve() for p in finals[0]["checkpoints"]] == [files[0].resolve()]
    state = torch.load(files[0], map_location="cpu", weights_only=True)
    assert state["timestamp"]["batch"] == STEP and weights_digest(state["model"]) == finals[0]["weights"]
