"""Faults, each with real processes: a killed callback worker, SIGTERM, a subscriber that
never reads, a halt retried through a long step, a full disk."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers.fault_callbacks import PidStepLog, StepList
from helpers.figures import memory, report
from helpers.waiting import wait_until
from programs.sigterm_trainer import make as make_sigterm_trainer
from torch.utils.data import DataLoader, Dataset

from offloop.bus import ControlClient, Subscriber, find_run
from offloop.trainer import Trainer

F = torch.nn.functional


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


class Held(Dataset):
    """`batches` batches of 8; fetching the first item of batch `hold`+1 sets `reached` and
    then calls `hold_fn()` (or waits for `release`, 90 s at most)."""

    def __init__(self, batches: int, hold: int, hold_fn=None) -> None:
        gen = torch.Generator().manual_seed(1)
        self.x = torch.randn(batches * 8, 8, generator=gen)
        self.y = (self.x[:, 0] > 0).long() + (self.x[:, 1] > 0).long()
        self.hold, self.hold_fn = hold, hold_fn
        self.reached, self.release = threading.Event(), threading.Event()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        if i == self.hold * 8:
            self.reached.set()
            if self.hold_fn is not None:
                self.hold_fn()
            elif not self.release.wait(timeout=90):
                raise TimeoutError("hold never released")
        return self.x[i], self.y[i]


def in_thread(fn) -> tuple[threading.Thread, list]:
    """Run fn in a thread; the list receives its exception, if any."""
    errors: list = []

    def run():
        try:
            fn()
        except BaseException as exc:  # noqa: B036 - reported by the test
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, errors


# ------------------------------------------------------------- a killed callback worker


def test_a_callback_worker_killed_mid_run_is_restarted_and_training_loses_nothing(tmp_path):
    batches, hold = 24, 8
    victim_log, steps_file = tmp_path / "victim.jsonl", tmp_path / "steps.json"
    dataset = Held(batches, hold)
    trainer = Trainer(model(), DataLoader(dataset, batch_size=8), f"{batches}ba",
                      loss_fn=F.cross_entropy, run_dir=tmp_path / "run", heartbeat_interval=0.2,
                      callbacks=[PidStepLog(str(victim_log)).in_own_process(), StepList(str(steps_file))])
    victim = 1  # the shared process (StepList's) first, then the victim's own
    assert trainer.workers.workers[victim].names == ["PidStepLog"]
    first_pid = trainer.workers.workers[victim].process.pid

    def victim_steps() -> list[dict]:
        if not victim_log.exists():
            return []
        return [json.loads(line) for line in victim_log.read_text().splitlines()]

    def kill_then_release():
        try:
            assert dataset.reached.wait(60), "training never reached the hold"
            # mid-run: the victim has handled every batch so far, then is killed outright
            wait_until(lambda: any(r["step"] == hold for r in victim_steps()), 60,
                       f"the victim to handle batch_end {hold}")
            os.kill(first_pid, signal.SIGKILL)
            wait_until(lambda: trainer.workers.restarts == 1 and trainer.workers.workers[victim].ready,
                       120, "the supervisor to restart the killed worker")
        finally:
            dataset.release.set()

    helper, errors = in_thread(kill_then_release)
    trainer.fit()  # no error
    helper.join(10)
    trainer.close()
    assert not errors, errors

    assert trainer.timestamp.batch == batches  # training finished max_duration
    untouched = json.loads(steps_file.read_text())
    assert untouched["steps"] == list(range(1, batches + 1)) and untouched["gaps"] == 0

    assert trainer.workers.restarts == 1
    assert len(trainer.workers.crashes) == 1 and f"pid {first_pid}" in trainer.workers.crashes[0]
    second_pid = trainer.workers.workers[victim].process.pid
    assert second_pid != first_pid
    records = victim_steps()
    first = [r for r in records if r["pid"] == first_pid]
    second = [r for r in records if r["pid"] == second_pid]
    assert len(first) + len(second) == len(records)
    assert [r["step"] for r in first] == list(range(1, hold + 1))
    # the fresh instance handled every later batch_end, once each, from its own first call...
    assert [r["step"] for r in second] == list(range(hold + 1, batches + 1))
    assert [r["n"] for r in second] == list(range(1, batches - hold + 1))
    # ...already knowing the run from the late-join state (it never saw init or fit_start)
    assert second[0]["run_name"] == "run" and second[0]["max_duration"] == f"{batches}ba"
    assert all(r["gaps"] == 0 for r in records)
    report("killed_worker", batches=batches, killed_after=hold, first_pid=first_pid,
           restarted_pid=second_pid, restarts=trainer.workers.restarts,
           untouched_batch_ends=len(untouched["steps"]), untouched_gaps=untouched["gaps"],
           restarted_handled=len(second))


# ---------------------------------------------------------------- the trainer killed outright


def test_a_trainer_killed_with_sigkill_is_noticed_by_its_workers_which_close_and_exit(spawn, tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "steps.json"
    child = spawn("slow_trainer", run_dir, 1000, 0.05, out)  # heartbeats every 0.2 s: 3 s timeout
    assert child.line(timeout=60)["run_dir"] == str(run_dir)
    info = find_run(str(run_dir))
    with Subscriber(info.endpoints["events"], info.endpoints["state"], topics=["batch_end"]) as sub:
        sub.connect(join_timeout=30)
        while (msg := sub.recv(timeout=30)) is None or msg.ts[1] < 3:
            assert msg is not None, "the trainer never reached batch 3"
    os.kill(child.popen.pid, signal.SIGKILL)
    killed = time.monotonic()
    deadline = killed + 3.0 + 30  # the heartbeat timeout, and slack for a loaded machine
    while not out.exists():
        assert time.monotonic() < deadline, "the worker never closed its callback"
        time.sleep(0.05)
    noticed = time.monotonic() - killed
    closed = json.loads(out.read_text())
    assert closed["steps"] and closed["steps"] == list(range(1, len(closed["steps"]) + 1))
    while Path(f"/proc/{closed['pid']}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # a zombie keeps /proc/<pid> until reaped: check its state instead
        status = Path(f"/proc/{closed['pid']}/status")
        if status.exists() and "zombie" in status.read_text():
            break
    child.wait(timeout=5)
    err = child.stderr()  # read to the end: the worker, its last writer, has exited
    assert "fell silent" in err and "no heartbeat" in err, err
    # not before the timeout, counted from the last message heard: a heartbeat (every 0.2 s)
    # or an event, which may have left up to one heartbeat interval before the kill
    assert noticed >= 3.0 - 0.2
    report("trainer_sigkill", heartbeat_timeout_s=3.0, noticed_after_s=round(noticed, 2),
           steps_seen=len(closed["steps"]))


def test_a_worker_stuck_in_a_callback_exits_once_its_trainer_is_killed(spawn, tmp_path):
    child = spawn("stuck_worker_trainer", tmp_path / "run")
    worker = child.line(timeout=60)["worker"]
    time.sleep(2)  # the callback is stuck by now (batch 3 comes at about 0.15 s)
    os.kill(child.popen.pid, signal.SIGKILL)
    killed = time.monotonic()
    # its heartbeat timeout (3 s) cannot fire: the main thread never returns from the callback;
    # the watch on the trainer's socket pair ends it after 2 x 3 + 5 s
    deadline = killed + 11 + 30
    while Path(f"/proc/{worker}").exists() and "zombie" not in _status(worker):
        assert time.monotonic() < deadline, f"worker {worker} outlived its trainer"
        time.sleep(0.1)
    assert time.monotonic() - killed >= 11 - 1  # not before its grace
    child.wait(timeout=5)
    assert "its trainer is gone and a callback has not returned" in child.stderr()


def _status(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return "zombie"


# ------------------------------------------------------------------------------ SIGTERM


def test_sigterm_checkpoints_publishes_fit_end_exits_143_and_the_checkpoint_resumes(spawn, tmp_path):
    batches, hold = 40, 5
    run_dir = tmp_path / "run"
    child = spawn("sigterm_trainer", run_dir, batches, hold)
    assert child.line(timeout=60)["run_dir"] == str(run_dir)
    info = find_run(str(run_dir))
    sub = Subscriber(info.endpoints["events"], info.endpoints["state"],
                     topics=["batch_end", "checkpoint_saved", "fit_end"], heartbeat_timeout=30)
    sub.connect(join_timeout=30)
    assert child.line(timeout=60) == {"holding": hold}
    os.kill(child.popen.pid, signal.SIGTERM)

    seen: dict[str, list] = {"batch_end": [], "checkpoint_saved": [], "fit_end": []}
    deadline = time.monotonic() + 60
    while not seen["fit_end"] and time.monotonic() < deadline:
        msg = sub.recv(timeout=0.5)
        if msg is not None and not msg.from_state:
            seen[msg.topic].append(msg)
    sub.close()
    assert child.wait(timeout=60) == 143, child.stderr()

    # the batch in progress finished, then the checkpoint was written and announced
    step = hold + 1
    assert seen["batch_end"][-1].ts[1] == step
    assert len(seen["checkpoint_saved"]) == 1
    saved = seen["checkpoint_saved"][0].data
    assert saved["tag"] == "sigterm" and saved["step"] == step
    path = Path(saved["path"])
    assert path.name == f"ep0-ba{step}-sigterm.pt" and path.exists()
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # nothing partial
    assert len(seen["fit_end"]) == 1
    fit_end = seen["fit_end"][0].data
    assert fit_end["stopped_by"] == {"reason": "SIGTERM", "client": "signal", "step": step}
    assert fit_end["checkpoints"] == [str(path)]
    run = json.loads((run_dir / "run.json").read_text())
    assert run["finished"] is True
    report("sigterm", exit_status=143, checkpoint_step=step, checkpoint=path.name)

    resumed, _ = make_sigterm_trainer(batches, None, load_path=path, publish=False,
                                      run_dir=tmp_path / "resumed")
    assert resumed.timestamp.batch == step
    resumed.fit()
    assert resumed.timestamp.batch == batches
    resumed.close()
    report("sigterm_resume", resumed_from=step, finished_at=resumed.timestamp.batch)


@pytest.mark.parametrize("mode, step, checkpointed", [
    ("no-checkpoint", 6, False),  # checkpoint_on_sigterm=False: fit_end and exit, no file
    ("in-eval", 5, True),  # SIGTERM during the evaluation after batch 5, past its control poll
])
def test_sigterm_without_a_checkpoint_or_during_eval_still_ends_the_run_cleanly(
        spawn, tmp_path, mode, step, checkpointed):
    run_dir = tmp_path / "run"
    child = spawn("sigterm_trainer", run_dir, 40, 5, mode)
    assert child.line(timeout=60)["run_dir"] == str(run_dir)
    info = find_run(str(run_dir))
    sub = Subscriber(info.endpoints["events"], info.endpoints["state"],
                     topics=["checkpoint_saved", "fit_end"], heartbeat_timeout=30)
    sub.connect(join_timeout=30)
    assert "holding" in child.line(timeout=60)
    os.kill(child.popen.pid, signal.SIGTERM)
    seen: dict[str, list] = {"checkpoint_saved": [], "fit_end": []}
    deadline = time.monotonic() + 60
    while not seen["fit_end"] and time.monotonic() < deadline:
        msg = sub.recv(timeout=0.5)
        if msg is not None and not msg.from_state:
            seen[msg.topic].append(msg.data)
    sub.close()
    assert child.wait(timeout=60) == 143, child.stderr()
    assert len(seen["fit_end"]) == 1
    assert seen["fit_end"][0]["stopped_by"] == {"reason": "SIGTERM", "client": "signal", "step": step}
    folder = run_dir / "checkpoints"
    files = sorted(p.name for p in folder.iterdir()) if folder.exists() else []
    if checkpointed:
        assert files == [f"ep0-ba{step}-sigterm.pt"]
        assert [c["step"] for c in seen["checkpoint_saved"]] == [step]
    else:
        assert files == [] and seen["checkpoint_saved"] == []
    assert json.loads((run_dir / "run.json").read_text())["finished"] is True


# -------------------------------------------------------------- a subscriber that never reads


def test_a_subscriber_that_stops_reading_costs_the_publisher_bounded_memory_and_loss_is_counted(
        spawn, tmp_path):
    events, payload = 300_000, 1024
    child = spawn("stalled_publisher", events, payload, tmp_path)
    started = child.line(timeout=60)
    endpoints = started["endpoints"]
    stalled = Subscriber(endpoints["events"], endpoints["state"], topics=["batch_end"],
                         heartbeat_timeout=60)
    stalled.connect(join_timeout=30)  # subscribed; from here on it reads nothing
    before = memory(started["pid"])
    (tmp_path / "go").touch()
    done = child.line(timeout=240)
    after = memory(started["pid"])
    assert done["published"] == events and done["tseq"] == events

    volume = events * payload
    peak_growth = after["VmHWM"] - before["VmRSS"]
    # the publisher holds at most its two bounded queues (10 000 messages each), never the stream
    assert peak_growth < volume / 8, (before, after, volume)
    figures = {"events": events, "payload_bytes": payload, "volume_mib": round(volume / 2**20, 1),
               "rss_before_mib": round(before["VmRSS"] / 2**20, 1),
               "rss_after_mib": round(after["VmRSS"] / 2**20, 1),
               "peak_rss_mib": round(after["VmHWM"] / 2**20, 1),
               "peak_growth_mib": round(peak_growth / 2**20, 1), "publisher_drops": done["drops"]}

    # the stalled subscriber finally reads what it holds, then the next heartbeats
    deadline = time.monotonic() + 60
    stats = stalled.stats
    while stats.received + stats.gaps < events and time.monotonic() < deadline:
        stalled.recv(timeout=0.2)
    assert stats.received + stats.gaps == events, stats
    assert 0 < stats.received < events and stats.gaps > 0 and stats.malformed == 0
    # and counts nothing more once later heartbeats have settled
    beats = stats.heartbeats
    wait_until(lambda: stalled.recv(timeout=0.1) is None and stats.heartbeats >= beats + 3, 30,
               "three more heartbeats", interval=0)
    assert stats.received + stats.gaps == events and stats.duplicates == 0
    report("stalled_subscriber", **figures, received=stats.received, gaps=stats.gaps)
    stalled.close()
    (tmp_path / "stop").touch()
    assert child.line(timeout=30) == {"closed": True}
    assert child.wait(timeout=30) == 0


# ------------------------------------------------------- a halt retried through a long step


def test_a_halt_retried_during_a_two_second_step_is_applied_exactly_once(tmp_path):
    batches, hold = 12, 4
    server = {}

    def two_second_step():
        # a slow step: at least 2 s, and on until the client has retried at least twice
        start = time.monotonic()
        wait_until(lambda: time.monotonic() - start >= 2.0
                   and server["control"].stats.duplicates >= 2, 30, "the client's retries")

    dataset = Held(batches, hold, hold_fn=two_second_step)
    trainer = Trainer(model(), DataLoader(dataset, batch_size=8), f"{batches}ba",
                      loss_fn=F.cross_entropy, run_dir=tmp_path / "run", heartbeat_interval=0.2)
    server["control"] = trainer.control
    sub = Subscriber(trainer.publisher.endpoints["events"], trainer.publisher.endpoints["state"],
                     topics=["control_request", "fit_end"])
    sub.connect()
    client = ControlClient(trainer.control.endpoint)
    acks: list = []

    def halt():
        assert dataset.reached.wait(60)
        acks.append(client.halt("stop in the slow step", retry=0.2, timeout=60))

    helper, errors = in_thread(halt)
    trainer.fit()
    helper.join(70)
    events = []
    while (msg := sub.recv(timeout=0.5)) is not None:
        if not msg.from_state:
            events.append(msg)
    sub.close()
    trainer.close()
    client.close()
    assert not errors, errors

    step = hold + 1  # the batch in progress when the halt arrived is the last one trained
    [ack] = acks
    assert ack.ok and ack.result["step"] == step
    assert trainer.timestamp.batch == step
    stats = trainer.control.stats
    assert stats.duplicates >= 2 and stats.received == stats.duplicates + 1
    assert stats.acked == 1 and stats.malformed == 0 and client.attempts >= stats.received
    applied = [m for m in events if m.topic == "control_request"]
    assert len(applied) == 1 and applied[0].data["op"] == "halt"  # read by the trainer once
    [fit_end] = [m for m in events if m.topic == "fit_end"]
    assert fit_end.data["stopped_by"] == {"reason": "stop in the slow step",
                                          "client": client.client_id, "step": step}
    assert trainer.stopped_by == fit_end.data["stopped_by"]
    report("halt_retried", step=step, attempts=client.attempts, received=stats.received,
           duplicates=stats.duplicates, acked=stats.acked, applied=len(applied))


# ---------------------------------------------------------------------------- a full disk


def test_a_checkpoint_on_a_full_disk_is_refused_clearly_and_training_goes_on(spawn, tmp_path):
    batches, limit = 20, 64 * 1024
    run_dir = tmp_path / "run"
    child = spawn("disk_full_trainer", run_dir, batches, limit)
    child.line(timeout=60)
    info = find_run(str(run_dir))
    assert child.line(timeout=60) == {"holding": 2}  # two batches trained; the third waits
    with ControlClient(info.endpoints["control"]) as client:
        ack = client.checkpoint("full", timeout=60)
    assert not ack.ok and ack.result["step"] == 3
    assert "cannot write checkpoint" in ack.error and "File too large" in ack.error
    done = child.line(timeout=60)
    assert done["done"] == batches  # training went on to max_duration
    assert done["checkpoints"] == [] and done["files"] == []  # no partial file left behind
    assert child.wait(timeout=30) == 0
    assert "training goes on" in child.stderr()
    report("disk_full", fsize_limit=limit, ack_ok=ack.ok, error=ack.error.split(": ")[-1],
           trained=done["done"], files_left=len(done["files"]))
