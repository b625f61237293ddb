"""One answer per request: two requests read at one batch never share a file or an ack,
a checkpoint is never written over, a saver's rotation leaves other clients' files alone,
and a request whose client has given up is dropped, not applied in a later fit."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from helpers.control_request import flood
from helpers.trainers import loader, mlp
from helpers.waiting import wait_until
from test_trainer_control import gated_run

from offloop.bus import ControlClient, ControlTimeout
from offloop.trainer import CheckpointError, Trainer
from offloop.workers import Callback
from offloop.workers.callbacks import CheckpointSaver

F = torch.nn.functional


def test_two_requests_with_the_same_tag_at_one_batch_get_two_files(tmp_path):
    trainer, acks, _ = gated_run(tmp_path, 20, [("checkpoint", {"tag": "x"}, "first"),
                                                ("checkpoint", {"tag": "x"}, "second")])
    names = sorted(Path(acks[k].result["path"]).name for k in ("first", "second"))
    assert names == ["ep0-ba3-x-2.pt", "ep0-ba3-x.pt"]
    assert all(Path(acks[k].result["path"]).is_file() for k in ("first", "second"))


def test_a_file_name_asked_twice_is_written_once_and_the_second_request_refused(tmp_path):
    trainer, acks, _ = gated_run(tmp_path, 20, [("checkpoint", {"filename": "mine.pt"}, "first"),
                                                ("checkpoint", {"filename": "mine.pt"}, "second"),
                                                ("checkpoint", {"tag": "other"}, "other")])
    # the two arrive in either order: the one read first is written, the other refused
    first, second = sorted((acks["first"], acks["second"]), key=lambda ack: not ack.ok)
    other = acks["other"]
    assert first.ok and Path(first.result["path"]).name == "mine.pt"
    assert not second.ok and "exists: a checkpoint is never written over" in second.error
    assert other.ok and Path(other.result["path"]).name == "ep0-ba3-other.pt"  # not refused with it
    assert torch.load(first.result["path"], weights_only=True)["timestamp"]["batch"] == 3


def test_save_checkpoint_never_writes_over_a_file(tmp_path):
    with Trainer(mlp(), loader(16, 8), "1ep", loss_fn=F.cross_entropy, run_dir=tmp_path / "run") as trainer:
        trainer.fit()
        path = trainer.save_checkpoint(filename="final.pt")
        before = path.read_bytes()
        with pytest.raises(CheckpointError, match="final.pt exists: a checkpoint is never written over"):
            trainer.save_checkpoint(filename="final.pt")
        assert path.read_bytes() == before
        assert trainer.save_checkpoint().name == "ep1-ba2.pt"
        assert trainer.save_checkpoint().name == "ep1-ba2-2.pt"  # a name the trainer makes: the next free one


class AsksAtEpochOne(Callback):
    """Another client asking for a checkpoint at the very step the saver saves."""

    def decides_on(self):
        return {"epoch_checkpoint": None}

    def epoch_checkpoint(self, state, logger) -> None:
        if state.timestamp.epoch == 1:
            self.request_checkpoint()


def test_a_savers_rotation_never_deletes_a_file_another_client_was_given(tmp_path):
    saver = CheckpointSaver(save_interval="1ep", num_checkpoints_to_keep=1, latest_filename=None)
    with Trainer(mlp(), loader(32, 8, shuffle=False), "3ep", loss_fn=F.cross_entropy, seed=3,
                 callbacks=[saver, AsksAtEpochOne().in_own_process()], run_dir=tmp_path / "run") as trainer:
        trainer.fit()
        folder = Path(trainer.checkpoints[0]).parent
    left = sorted(p.name for p in folder.iterdir())
    # the saver kept its newest; the other client's file at batch 4 (the saver's was rotated away)
    assert len(left) == 2 and "ep3-ba12.pt" in left
    assert any(name.startswith("ep1-ba4") for name in left)


def test_a_request_whose_client_gave_up_between_fits_is_dropped_not_applied(tmp_path):
    with Trainer(mlp(), loader(32, 8), "1ep", loss_fn=F.cross_entropy, run_dir=tmp_path / "run") as trainer:
        trainer.fit()  # between fits nothing reads requests: this one waits in the inbox
        with ControlClient(trainer.control.endpoint, client_id="impatient") as client, \
                pytest.raises(ControlTimeout):
            client.halt("too late", timeout=0.3, retry=10)
        wait_until(lambda: trainer.control.inbox and trainer.control.inbox[0].given_up(time.time()), 10,
                   "the halt to be in the inbox, its client's 0.3 s over")
        trainer.fit(duration="3ep")
        assert trainer.timestamp.epoch == 3 and trainer.stopped_by is None
        assert trainer.controller.given_up == 1


def test_thousands_of_given_up_halts_never_make_a_checkpoint_request_written_twice(tmp_path):
    # issue 44 finding 4: 4 200 halts the trainer refused as "given up" pushed a client's
    # checkpoint out of the answers kept (4 096): its retry was written a second time
    trainer = Trainer(mlp(), loader(64, 8), "100000ep", loss_fn=F.cross_entropy,
                      run_dir=tmp_path / "run")
    got: dict = {}

    def attack():
        with ControlClient(trainer.control.endpoint, client_id="owner") as client:
            try:
                got["first"] = client.checkpoint("once", timeout=60)
                got["flood"] = flood(trainer.control.endpoint, 4200, window=200, wait=1e-9)
                got["retry"] = client.request("checkpoint", {"tag": "once"}, req=got["first"].req,
                                              timeout=60)
            finally:
                got["halt"] = client.halt("done", timeout=60)

    thread = threading.Thread(target=attack, daemon=True)
    thread.start()
    trainer.fit()
    thread.join(60)
    refused = trainer.publisher.refusals()  # what the heartbeats carry: every refusal counted
    trainer.close()
    assert refused["control_given_up"] == 4200
    assert got["first"].ok and got["retry"] == got["first"]
    assert len(got["flood"]) == 4200 and not any(reply["ok"] for reply in got["flood"])
    assert trainer.controller.given_up == 4200 and got["halt"].ok
    written = sorted(p.name for p in Path(got["first"].result["path"]).parent.iterdir())
    assert written == [Path(got["first"].result["path"]).name]  # written once
    stats = trainer.control.stats  # 4 200 refusals, 4 096 kept: the first 104 forgotten, no answer
    assert (stats.evicted_refusals, stats.evicted_acks, stats.duplicates) == (104, 0, 1)
    print({"case": "given-up flood", "refused": 4200, "evicted_refusals": stats.evicted_refusals,
           "evicted_acks": stats.evicted_acks, "duplicates": stats.duplicates,
           "batches": trainer.timestamp.batch})


def test_a_halt_that_arrives_between_fits_is_refused_by_the_next_fit_not_applied(tmp_path):
    # issue 44 finding 5: a halt with no `wait` never expired and stopped a later fit()
    import msgpack
    import zmq

    from offloop.bus.wire import encode_request

    with Trainer(mlp(), loader(32, 8), "1ep", loss_fn=F.cross_entropy, run_dir=tmp_path / "run") as trainer:
        trainer.fit()
        ctx = zmq.Context()
        raw = ctx.socket(zmq.DEALER)
        raw.linger = 0
        raw.connect(trainer.control.endpoint)
        raw.send(encode_request("ctl", client="no-wait", req=1, op="halt", args={"reason": "old"},
                                t=time.time()))  # no `wait`: a client that never gives up
        out: dict = {}

        def patient():  # a client still waiting when fit 2 begins
            with ControlClient(trainer.control.endpoint, client_id="patient") as client:
                out["halt"] = client.halt("between fits", timeout=60)

        thread = threading.Thread(target=patient, daemon=True)
        thread.start()
        wait_until(lambda: len(trainer.control.inbox) == 2, 10, "both halts in the inbox")
        trainer.fit(duration="3ep")
        assert trainer.timestamp.epoch == 3 and trainer.stopped_by is None
        assert trainer.controller.outlived == 2 and trainer.controller.given_up == 0
        assert trainer.publisher.refusals()["control_outlived"] == 2
        thread.join(30)
        assert raw.poll(10_000)
        reply = msgpack.unpackb(raw.recv())
        raw.close()
        ctx.destroy(linger=0)
    for ack in (out["halt"], reply):
        ack = ack if isinstance(ack, dict) else ack.__dict__
        assert not ack["ok"] and "arrived before fit 2 began" in ack["error"]
        assert "not applied in a later fit" in ack["error"]
