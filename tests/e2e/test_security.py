"""CURVE keys: only authorised clients reach a trainer with keys; no exposure without them."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import zmq
from helpers.waiting import wait_for_file, wait_until
from torch import nn

from offloop import Callback
from offloop.bus import (
    ControlClient,
    ControlTimeout,
    PublisherSilent,
    RunNotFound,
    Subscriber,
    find_run,
)
from offloop.bus.security import SecurityError, generate_keys, load_client_keys, load_server_keys
from offloop.bus.wire import decode_reply, encode_request
from offloop.trainer import ConfigError, Trainer

ROOT = Path(__file__).parent.parent.parent


def slow_batches(n: int, delay: float):
    gen = torch.Generator().manual_seed(0)
    for _ in range(n):
        time.sleep(delay)
        x = torch.randn(8, 4, generator=gen)
        yield x, (x[:, 0] > 0).long()


class Batches:
    def __init__(self, n, delay):
        self.n, self.delay = n, delay

    def __iter__(self):
        return slow_batches(self.n, self.delay)

    def __len__(self):
        return self.n


def test_listening_beyond_loopback_without_keys_is_refused_unless_insecure(tmp_path):
    with pytest.raises(ConfigError, match=r"refusing to listen on '0.0.0.0' without keys.*offloop keys"):
        Trainer(nn.Linear(4, 2), Batches(1, 0), "1ba", loss_fn=nn.functional.cross_entropy,
                host="0.0.0.0", run_dir=tmp_path / "a")
    trainer = Trainer(nn.Linear(4, 2), Batches(1, 0), "1ba", loss_fn=nn.functional.cross_entropy,
                      host="0.0.0.0", insecure=True, run_dir=tmp_path / "b")
    assert trainer.control.endpoint.startswith("tcp://0.0.0.0:")
    trainer.close()


def test_only_authorised_keys_reach_a_trainer_with_keys(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="offloop")
    keys = tmp_path / "keys"
    generate_keys(keys, "alice")
    strangers = tmp_path / "other"
    generate_keys(strangers, "mallory")  # a valid key pair the trainer never authorised
    # up to 40 s of training: the authorised halt below ends it (a few seconds in), so a slow
    # machine's subprocesses and timeouts never outlast the run it is meant to stop
    trainer = Trainer(nn.Linear(4, 2), Batches(4000, 0.01), "4000ba", loss_fn=nn.functional.cross_entropy,
                      keys=keys, run_dir=tmp_path / "run")
    fit = threading.Thread(target=trainer.fit, daemon=True)
    fit.start()
    try:
        info = find_run(str(tmp_path / "run"))
        assert info.curve_public  # clients learn the trainer's public key from run.json
        alice = load_client_keys(keys, "alice", info.curve_public)
        mallory = load_client_keys(strangers, "mallory", info.curve_public)

        with pytest.raises(PublisherSilent):  # the event stream is encrypted too
            Subscriber(info.endpoints["events"], info.endpoints["state"], topics=["batch_end"]).connect(1.0)
        sub = Subscriber(info.endpoints["events"], info.endpoints["state"], topics=["batch_end"], curve=alice)
        sub.connect(join_timeout=10)
        assert sub.recv(timeout=10) is not None

        with pytest.raises(ControlTimeout):
            ControlClient(info.endpoints["control"], curve=mallory).halt("mallory says stop", timeout=1.5)
        # refused, counted and logged, each attempt (a retrying client reconnects)
        wait_until(lambda: trainer.control.stats.unauthorized >= 1, 10, "the refusal to be counted")
        wait_until(lambda: caplog.text.count("its key is not authorised")
                   == trainer.control.stats.unauthorized, 10, "a log line for each refusal")
        with pytest.raises(ControlTimeout):  # no keys at all: no handshake, nothing gets through
            ControlClient(info.endpoints["control"]).halt("no keys at all", timeout=1.5)
        assert trainer.control.stats.received == 0  # nothing reached the trainer
        assert fit.is_alive() and not trainer.controller.stop  # training went on

        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        # `ls` reads a keyed run's progress only with an authorised key
        listed = [subprocess.run([sys.executable, "-m", "offloop.cli", "ls", "--runs-root", str(tmp_path),
                                  "--json", *extra], capture_output=True, text=True, timeout=60, env=env)
                  for extra in ([], ["--keys", str(keys), "--key-name", "alice"])]
        rows = [json.loads(done.stdout.splitlines()[0]) for done in listed]
        assert rows[0]["progress"] == "-" and rows[1]["progress"].startswith("ep 0 ba "), rows
        halt = subprocess.run([sys.executable, "-m", "offloop.cli", "halt", str(tmp_path / "run"),
                               "--keys", str(keys), "--key-name", "alice", "--reason", "alice"],
                              capture_output=True, text=True, timeout=60, env=env)
        assert halt.returncode == 0, halt.stderr
        fit.join(timeout=30)
        assert trainer.stopped_by["reason"] == "alice"
        sub.close()
    finally:
        trainer.controller.stop = True
        fit.join(timeout=30)
        trainer.close()


def test_keys_are_owner_only(tmp_path):
    generate_keys(tmp_path / "k", "bob")
    assert oct((tmp_path / "k").stat().st_mode & 0o777) == "0o700"
    for secret in (tmp_path / "k").glob("*.key_secret"):
        assert oct(secret.stat().st_mode & 0o777) == "0o600"


class MarkFirstBatch(Callback):
    """Proves the trainer's own worker got in: it runs in a worker process."""

    def __init__(self, path):
        self.path = str(path)

    def batch_end(self, state, logger):
        Path(self.path).touch()


def _drain_until_silent(sub: Subscriber, timeout: float) -> bool:
    """True once `sub` hears no heartbeat for its heartbeat_timeout, within `timeout` s."""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            sub.recv(timeout=0.2)
    except PublisherSilent:
        return True
    return False


def _info_asker(endpoint: str, curve):
    """One connection to a state socket, kept open: each call asks it for the run's info."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    curve.apply(sock)
    sock.connect(endpoint)

    def ask() -> dict:
        sock.send(encode_request("info_req"))
        assert sock.poll(10_000), "no answer within 10 s"
        return decode_reply(sock.recv())
    return ask


def test_a_monitor_key_reads_but_cannot_halt_and_revocations_apply_to_a_live_connection(tmp_path):
    keys = tmp_path / "keys"
    generate_keys(keys, "watcher", role="monitor")
    generate_keys(keys, "boss")
    generate_keys(keys, "eve")
    trainer = Trainer(nn.Linear(4, 2), Batches(4000, 0.01), "4000ba", loss_fn=nn.functional.cross_entropy,
                      keys=keys, run_dir=tmp_path / "run", callbacks=[MarkFirstBatch(tmp_path / "seen")])
    fit = threading.Thread(target=trainer.fit, daemon=True)
    fit.start()
    subs = []
    try:
        info = find_run(str(tmp_path / "run"))
        watcher, boss, eve = (load_client_keys(keys, name, info.curve_public) for name in ("watcher", "boss", "eve"))
        # the trainer's own worker joined with a key pair made in memory: none was written to authorized/
        wait_for_file(tmp_path / "seen", 30)
        assert sorted(p.name for p in (keys / "authorized").iterdir()) == ["boss.key", "eve.key", "watcher.key"]

        # a monitor key reads events and the late-join state, and its halt is refused, saying why
        watching = Subscriber(info.endpoints["events"], info.endpoints["state"], topics=["batch_end"],
                              curve=watcher, heartbeat_timeout=3)
        subs.append(watching)
        assert watching.connect(join_timeout=10) is not None and watching.recv(timeout=10) is not None
        ack = ControlClient(info.endpoints["control"], curve=watcher).halt("watcher says stop", timeout=10)
        assert not ack.ok and "authorised as monitor" in ack.error and "--role control" in ack.error, ack
        assert trainer.control.stats.unauthorized == 1 and not trainer.controller.stop

        # eve, a control key, is connected to all three sockets when her key is removed
        eves = Subscriber(info.endpoints["events"], info.endpoints["state"], topics=["batch_end"], curve=eve,
                          heartbeat_timeout=2)
        subs.append(eves)
        eves.connect(join_timeout=10)
        eve_control = ControlClient(info.endpoints["control"], curve=eve)
        ack = eve_control.checkpoint("before", timeout=30)
        assert ack.ok, ack
        eve_asks = _info_asker(info.endpoints["state"], eve)
        assert eve_asks()["k"] == "info"
        (keys / "authorized" / "eve.key").unlink()
        ack = eve_control.halt("eve, revoked", timeout=10)  # on her open connections: refused at once
        assert not ack.ok and "no longer authorised" in ack.error, ack
        refused = eve_asks()
        assert refused["k"] == "error" and "no longer authorised" in refused["error"], refused
        with pytest.raises(RunNotFound, match="no run answered"):  # a new connection fails its handshake
            find_run(info.endpoints["state"], curve=eve, timeout=2)
        # her events connection is cut (every subscriber's is; the others reconnect) and she
        # cannot join again: she hears no heartbeat from then on
        wait_until(lambda: trainer.publisher.stats.cuts == 1, 5, "her connection to be cut")
        assert _drain_until_silent(eves, timeout=15)
        before = watching.stats.received
        wait_until(lambda: watching.recv(timeout=0.5) is not None and watching.stats.received > before + 5, 10,
                   "the watcher to hear events again")

        # a role changed in place: boss turned monitor is refused, turned control again is obeyed
        generate_keys(keys, "boss", role="monitor")
        ack = ControlClient(info.endpoints["control"], curve=boss).halt("boss as monitor", timeout=10)
        assert not ack.ok and "authorised as monitor" in ack.error, ack
        generate_keys(keys, "boss", role="control")
        ack = ControlClient(info.endpoints["control"], curve=boss).halt("boss", timeout=10)
        assert ack.ok, ack
        fit.join(timeout=30)
        assert trainer.stopped_by["reason"] == "boss"
    finally:
        for sub in subs:
            sub.close()
        trainer.controller.stop = True
        fit.join(timeout=30)
        trainer.close()


def test_a_run_without_keys_tells_any_local_process_only_how_to_connect(tmp_path):
    trainer = Trainer(nn.Linear(4, 2), Batches(2, 0), "2ba", loss_fn=nn.functional.cross_entropy,
                      run_dir=tmp_path / "run", hparams={"lr": 0.1})
    try:
        trainer.fit()
        local = find_run(str(tmp_path / "run"))  # the owner-only file has it all
        assert local.run_dir and local.extra["config"]["hparams"] == {"lr": 0.1}
        asked = find_run(local.endpoints["state"], timeout=5)  # any local account can ask this
        assert (asked.run_id, asked.endpoints, asked.pid) == (local.run_id, local.endpoints, local.pid)
        # the config, which the late-join state carries to anyone anyway, and not the run's folder
        assert asked.extra == {"config": local.extra["config"]} and asked.run_dir == ""
    finally:
        trainer.close()


def test_offloop_keys_authorises_a_client_with_the_role_asked_and_changes_it_when_asked_again(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def keys(*extra):
        return subprocess.run([sys.executable, "-m", "offloop.cli", "keys", str(tmp_path / "k"), "--client", "dash",
                               *extra], capture_output=True, text=True, timeout=60, env=env)

    made = keys("--role", "monitor")
    assert made.returncode == 0 and "authorised as monitor" in made.stdout, made
    public = (tmp_path / "k" / "dash.key_secret").read_bytes()
    access = load_server_keys(tmp_path / "k").access
    [(name, role)] = access._files.values()
    assert (name, role) == ("dash", "monitor")
    assert keys().returncode == 0  # again, with the default role: control; the key pair is kept
    assert (tmp_path / "k" / "dash.key_secret").read_bytes() == public
    assert access.refresh() is False and list(access._files.values()) == [("dash", "control")]
    refused = keys("--role", "admin")
    assert refused.returncode == 2 and "invalid choice: 'admin'" in refused.stderr
    with pytest.raises(SecurityError, match="role 'admin' is not one of monitor, control"):
        generate_keys(tmp_path / "k", "dash", role="admin")
