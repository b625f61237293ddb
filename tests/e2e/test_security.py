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
from torch import nn

from offloop.bus import ControlClient, ControlTimeout, PublisherSilent, Subscriber, find_run
from offloop.bus.security import generate_keys, load_client_keys
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


def _wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)
    return predicate()


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
        assert _wait_for(lambda: trainer.control.stats.unauthorized >= 1)
        assert _wait_for(lambda: caplog.text.count("its key is not authorised")
                         == trainer.control.stats.unauthorized)
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
