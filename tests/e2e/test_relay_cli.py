"""`offloop relay` between a real training job and the CLI's monitors, in other processes."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers.waiting import wait_for_file
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
