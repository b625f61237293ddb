"""`offloop relay` between a real training job and the CLI's monitors, in other processes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers.waiting import wait_for_file, wait_until
from test_cli_control import ROOT, offloop

from offloop.bus import read_run_info
from offloop.bus.security import generate_keys


def relay(runs: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "offloop.cli", "relay", *args, "--announce", runs],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, cwd=ROOT.parent)


def test_monitors_list_watch_and_halt_a_run_through_the_relay_which_then_exits(spawn, tmp_path):
    run_dir = tmp_path / "runs" / "job"
    trainer = spawn("slow_trainer", run_dir, 2000, 0.02)
    trainer.line()
    wait_for_file(run_dir / "run.json")
    there = tmp_path / "monitor-host-runs"
    proc = relay(str(there), str(run_dir))
    try:
        wait_for_file(there / "job" / "run.json")
        relayed = read_run_info(there / "job")
        assert relayed.endpoints != read_run_info(run_dir).endpoints

        listed = offloop("ls", "--runs-root", str(there), "--json")
        row = json.loads(listed.stdout.splitlines()[0])
        assert row["name"] == "job" and row["status"] == "live", listed.stdout

        screen = offloop("attach", "job", "--runs-root", str(there), "--once")
        assert screen.returncode == 0, screen.stderr
        assert "batches/s" in screen.stdout, screen.stdout

        halt = offloop("halt", relayed.endpoints["state"], "--reason", "through the relay")
        assert halt.returncode == 0, halt.stderr
        step = int(halt.stdout.split("after batch ")[1].split()[0])
        assert trainer.line(timeout=60)["done"] == step
        trainer.wait(timeout=30)
        out, err = proc.communicate(timeout=60)  # the run's final heartbeats end the relay
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    assert "finished; forwarded" in err and "1 control" in err, err
    assert read_run_info(there / "job").finished
    stopped_by = read_run_info(run_dir).extra["stopped_by"]
    assert stopped_by["reason"] == "through the relay", stopped_by


def test_with_keys_a_monitor_key_is_refused_a_halt_at_the_relay_and_a_control_key_halts(spawn, tmp_path):
    keys = tmp_path / "keys"
    generate_keys(keys, "relay", role="control")  # the trainer admits the relay as control
    generate_keys(keys, "watcher", role="monitor")  # the relay admits these, with their roles
    generate_keys(keys, "operator", role="control")
    run_dir = tmp_path / "runs" / "job"
    trainer = spawn("slow_trainer", run_dir, 2000, 0.02, env={"SLOW_TRAINER_KEYS": str(keys)})
    trainer.line()
    wait_for_file(run_dir / "run.json")
    there = tmp_path / "monitor-host-runs"
    proc = relay(str(there), str(run_dir), "--keys", str(keys))
    try:
        wait_for_file(there / "job" / "run.json")
        as_watcher = ("--runs-root", str(there), "--keys", str(keys), "--key-name", "watcher")
        screen = offloop("attach", "job", *as_watcher, "--once")
        assert screen.returncode == 0 and "batches/s" in screen.stdout, screen.stderr

        refused = offloop("halt", "job", *as_watcher)
        assert refused.returncode == 1
        assert "refused by the relay" in refused.stderr and "'watcher' is authorised as monitor" \
            in refused.stderr, refused.stderr

        halt = offloop("halt", "job", "--runs-root", str(there), "--keys", str(keys), "--key-name", "operator")
        assert halt.returncode == 0, halt.stderr
        step = int(halt.stdout.split("after batch ")[1].split()[0])
        assert trainer.line(timeout=60)["done"] == step
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    assert "refused 1" in err, err


def test_a_run_with_keys_is_refused_a_relay_without_keys_of_its_own(spawn, tmp_path):
    """Issue 44: given only the trainer side's key (--upstream-keys), a relay listened on
    loopback without keys, and a halt with no keys at all went through it to the run."""
    keys = tmp_path / "keys"
    generate_keys(keys, "relayup", role="control")  # the trainer admits the relay's key as control
    run_dir = tmp_path / "runs" / "job"
    trainer = spawn("slow_trainer", run_dir, 2000, 0.02, env={"SLOW_TRAINER_KEYS": str(keys)})
    trainer.line()
    wait_for_file(run_dir / "run.json")
    there = tmp_path / "monitor-host-runs"
    proc = relay(str(there), str(run_dir), "--upstream-keys", str(keys), "--key-name", "relayup")
    try:
        wait_until(lambda: proc.poll() is not None or (there / "job" / "run.json").exists(), 60,
                   "the relay to exit or announce itself")
        if proc.poll() is None:  # it started: what any local account can then do through it
            halt = offloop("halt", read_run_info(there / "job").endpoints["state"], "--reason",
                           "no keys at all")
            pytest.fail(f"the relay started without keys of its own; a halt with no keys through it: "
                        f"exit {halt.returncode}, {halt.stdout.strip()!r} {halt.stderr.strip()!r}")
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    assert proc.returncode == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("offloop: error: "), err  # one line, no traceback
    assert "run job has keys" in lines[0] and "--keys DIR" in lines[0], err
    assert not (there / "job").exists()  # nothing announced
    assert trainer.popen.poll() is None and not read_run_info(run_dir).finished  # training goes on
