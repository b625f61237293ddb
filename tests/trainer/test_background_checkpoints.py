"""Checkpoints written off the training thread: the loop pays for the copy only; the ack,
checkpoint_saved, fit()'s return and a CheckpointSaver's rotation wait until the file is
durable; one write at a time; a kill mid-write leaves the checkpoint before it whole."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import torch
from common import GatedDataset
from helpers.data import dataset as data
from helpers.trainers import loader, mlp, small_trainer
from helpers.waiting import wait_until

from offloop import Callback
from offloop.bus import ControlClient, Subscriber
from offloop.callbacks import CheckpointSaver
from offloop.trainer import Trainer, checkpoint

F = torch.nn.functional


class SlowDisk:
    """save_checkpoint as the writer thread calls it, `delay` seconds slower: when each
    write began and became durable, and the training thread's batch at both moments."""

    def __init__(self, monkeypatch, delay: float) -> None:
        self.delay, self.trainer = delay, None
        self.writes: list[dict] = []
        real = checkpoint.save_checkpoint

        def slow(path, payload):
            entry = {"path": Path(path), "began": time.monotonic(), "step": payload["timestamp"]["batch"],
                     "batch_at_start": self.trainer.timestamp.batch if self.trainer else None}
            self.writes.append(entry)
            time.sleep(self.delay)
            real(path, payload)
            entry["durable"] = time.monotonic()
            entry["batch_at_end"] = self.trainer.timestamp.batch if self.trainer else None
            return path

        monkeypatch.setattr(checkpoint, "save_checkpoint", slow)


def test_a_kill_during_the_background_write_leaves_the_checkpoint_before_it_whole(spawn, tmp_path):
    child = spawn("killed_background_write", tmp_path / "run")
    first = Path(child.line(timeout=60)["first"])
    inside = Path(child.line(timeout=60)["inside"])  # half of the second is on disk
    trained = child.line(timeout=60)  # the training thread went on to the end meanwhile
    # taken at the first batch end after the request arrived (batch 2 waits for it)
    assert trained["trained"] == 40 and trained["taken"] in (1, 2)
    assert trained["acked"] is False  # no ack for a file that is not durable
    child.popen.kill()
    assert child.wait() == -9
    folder = first.parent
    assert inside.parent == folder and inside.name.startswith(f".ep0-ba{trained['taken']}-second.pt.pid")
    assert torch.load(first, weights_only=True)["timestamp"]["batch"] == 0  # whole
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == [first.name]
    # the next run in that folder removes what the killed writer left
    Trainer(mlp(), loader(dataset=data(16), batch_size=8), "1ba", loss_fn=F.cross_entropy,
            run_dir=tmp_path / "run").close()
    assert sorted(p.name for p in folder.iterdir()) == [first.name]


def test_the_loop_trains_on_while_a_checkpoint_is_written_and_its_ack_waits_until_it_is_durable(
        tmp_path, monkeypatch):
    disk = SlowDisk(monkeypatch, delay=1.0)
    dataset = GatedDataset(data(64), 20)  # batch 3 waits for the request
    trainer = Trainer(mlp(), loader(dataset=dataset, batch_size=8), "30ep", loss_fn=F.cross_entropy,
                      seed=7, run_dir=tmp_path / "run")
    disk.trainer = trainer
    got: dict = {}

    def ask() -> None:
        assert dataset.reached.wait(30)
        with ControlClient(trainer.control.endpoint) as client:
            threading.Timer(0.5, dataset.release.set).start()
            got["ack"] = client.request("checkpoint", {"tag": "slow"}, timeout=30,
                                        on_taken=lambda r: got.setdefault("taken", (r, time.monotonic())))
            got["acked_at"] = time.monotonic()

    helper = threading.Thread(target=ask, daemon=True)
    helper.start()
    trainer.fit()
    helper.join(30)
    trainer.close()
    (write,) = disk.writes
    taken, taken_at = got["taken"]
    assert taken["step"] == 3 and got["ack"].ok and got["ack"].result["step"] == 3
    assert taken_at < write["durable"] <= got["acked_at"]  # the note at the copy, the ack once durable
    assert write["batch_at_end"] > write["batch_at_start"]  # the loop trained on meanwhile
    assert torch.load(got["ack"].result["path"], weights_only=True)["timestamp"]["batch"] == 3


def test_a_checkpoint_asked_for_during_a_write_waits_for_it_then_is_taken(tmp_path, monkeypatch):
    disk = SlowDisk(monkeypatch, delay=1.0)
    dataset = GatedDataset(data(64), 20)
    trainer = Trainer(mlp(), loader(dataset=dataset, batch_size=8), "40ep", loss_fn=F.cross_entropy,
                      seed=7, run_dir=tmp_path / "run")
    disk.trainer = trainer
    acks: dict = {}
    second_sent = threading.Event()

    def ask(key: str, after: threading.Event) -> None:
        with ControlClient(trainer.control.endpoint) as client:
            assert after.wait(30)
            acks[key] = client.request(
                "checkpoint", {"tag": key}, timeout=30,
                on_taken=lambda r: (second_sent.set() if key == "one" else None))

    threads = [threading.Thread(target=ask, args=("one", dataset.reached), daemon=True),
               threading.Thread(target=ask, args=("two", second_sent), daemon=True)]
    for thread in threads:
        thread.start()

    def release() -> None:  # batch 3 waits, and the first request is sent, until it arrives
        assert dataset.reached.wait(30)
        wait_until(lambda: trainer.control.stats.received >= 1, 10, "the first request")
        dataset.release.set()

    threading.Thread(target=release, daemon=True).start()
    trainer.fit()
    for thread in threads:
        thread.join(30)
    trainer.close()
    one, two = disk.writes
    assert acks["one"].ok and acks["two"].ok
    assert one["step"] == 3 and two["step"] > 3  # the second arrived while the first was written
    assert two["began"] >= one["durable"]  # one write at a time: it waited for the first
    assert trainer.checkpoints == [acks["one"].result["path"], acks["two"].result["path"]]


def test_fit_returns_only_once_the_last_checkpoint_is_durable(tmp_path, monkeypatch):
    disk = SlowDisk(monkeypatch, delay=1.5)
    dataset = GatedDataset(data(64), 60)  # the last batch of the only epoch
    trainer = Trainer(mlp(), loader(dataset=dataset, batch_size=8), "1ep", loss_fn=F.cross_entropy,
                      seed=7, run_dir=tmp_path / "run")
    endpoints = trainer.publisher.endpoints
    sub = Subscriber(endpoints["events"], endpoints["state"],
                     topics=["checkpoint_taken", "checkpoint_saved", "fit_end"])
    sub.connect()
    got: dict = {}

    def ask() -> None:
        assert dataset.reached.wait(30)
        with ControlClient(trainer.control.endpoint) as client:
            threading.Timer(0.3, dataset.release.set).start()
            got["ack"] = client.request("checkpoint", {"tag": "last"}, timeout=30)

    helper = threading.Thread(target=ask, daemon=True)
    helper.start()
    trainer.fit()
    returned = time.monotonic()
    (write,) = disk.writes
    assert write["durable"] <= returned
    path = Path(trainer.checkpoints[0])
    assert path.is_file() and path.name == "ep0-ba8-last.pt"
    seen = []
    while (msg := sub.recv(timeout=2)) is not None:
        if not msg.from_state:
            seen.append((msg.topic, msg.data, msg.ts[1]))
            if msg.topic == "fit_end":
                break
    sub.close()
    helper.join(30)
    trainer.close()
    # taken, then saved once durable (both stamped with the step the file holds), then fit_end
    assert [(t, at) for t, _, at in seen] == [("checkpoint_taken", 8), ("checkpoint_saved", 8),
                                              ("fit_end", 8)]
    assert seen[0][1]["path"] == seen[1][1]["path"] == str(path)
    assert seen[2][1]["checkpoints"] == [str(path)] and got["ack"].ok


class Counted(Callback):
    """Remembers the last batch it saw: its state beside a checkpoint says which step's it is."""

    def __init__(self) -> None:
        self.seen = 0

    def batch_end(self, state, logger) -> None:
        self.seen = state.timestamp.batch

    def state_dict(self) -> dict:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.seen = state["seen"]


def test_a_saver_deciding_waits_for_the_copy_not_the_write_and_callback_state_is_of_the_step_held(
        tmp_path, monkeypatch):
    disk = SlowDisk(monkeypatch, delay=3.0)
    saver = CheckpointSaver(save_interval="1ep")
    trainer = small_trainer(tmp_path, "2ep", seed=1, callbacks=[Counted(), saver])
    disk.trainer = trainer
    trainer.fit()
    trainer.close()
    # at the ends of epochs 1 and 2 (the saver decides at the last one too: the trainer waits)
    first, second = disk.writes
    assert (first["step"], second["step"]) == (4, 8)
    assert first["batch_at_end"] == 8  # the loop trained epoch 2 while the first was written
    assert second["began"] >= first["durable"]
    # the wait at epoch 1's epoch_checkpoint ended when the checkpoint was taken, not written
    waits = list(trainer.services.decisions.waits)
    assert waits[0] < disk.delay / 2, waits
    for path, step in zip(trainer.checkpoints, (4, 8), strict=True):
        assert torch.load(path, weights_only=True)["timestamp"]["batch"] == step
        entries = json.loads(Path(f"{path}.callbacks-0.json").read_text())["callbacks"]
        assert [e["state"] for e in entries if e["name"] == "Counted"] == [{"seen": step}]
    latest = trainer.save_folder / "latest"  # the saver's, once each file was durable
    assert latest.resolve() == Path(trainer.checkpoints[1]).resolve()
