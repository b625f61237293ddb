"""Halt and checkpoint requests over the control channel; exact resume from a checkpoint."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from common import GatedDataset, ask
from helpers.data import dataset as data
from helpers.trainers import loader, mlp
from helpers.waiting import wait_until

from offloop.bus import Subscriber
from offloop.trainer import Trainer

F = torch.nn.functional


def gated_run(tmp_path: Path, gate_at: int, requests: list[tuple[str, dict]], **kw):
    """Train 3 epochs of 8 batches; the requests arrive while batch (gate_at-1)//8+1 loads,
    in the order given (each is sent once the one before it has reached the server)."""
    dataset = GatedDataset(data(64), gate_at)
    trainer = Trainer(mlp(), loader(dataset=dataset, batch_size=8), "3ep", loss_fn=F.cross_entropy,
                      seed=7, run_dir=tmp_path / "run", **kw)
    endpoints = trainer.publisher.endpoints
    sub = Subscriber(endpoints["events"], endpoints["state"])
    sub.connect()
    acks: dict = {}

    def line_up():
        assert dataset.reached.wait(30)
        threads = []
        for n, request in enumerate(requests):
            op, args, *key = request
            threads.append(ask(trainer.control.endpoint, op, args, acks, key=key[0] if key else None))
            wait_until(lambda n=n: trainer.control.stats.received > n, 10, f"request {n + 1} to arrive")
        dataset.release.set()
        for thread in threads:
            thread.join(30)

    helper = threading.Thread(target=line_up, daemon=True)
    helper.start()
    trainer.fit()
    helper.join(30)
    topics = []
    while (msg := sub.recv(timeout=0.5)) is not None:
        if not msg.from_state:
            topics.append((msg.topic, msg.ts, msg.data))
    sub.close()
    trainer.close()
    return trainer, acks, topics


def test_halt_stops_after_the_current_batch_and_closes_the_run(tmp_path):
    # item 20 of the shuffled epoch belongs to the third batch (items 17..24)
    trainer, acks, events = gated_run(tmp_path, 20, [("halt", {"reason": "test"})])
    assert acks["halt"].ok and acks["halt"].result["step"] == 3
    assert trainer.timestamp.batch == 3 and trainer.stopped_by["reason"] == "test"
    after = [topic for topic, ts, _ in events if ts[1] == 3]
    tail = after[after.index("batch_end"):]
    # Composer's stop_training: the batch finishes, its checkpoint event fires, then fit_end
    assert tail == ["batch_end", "control_request", "batch_checkpoint", "fit_end"]
    assert events[-1][2]["stopped_by"]["reason"] == "test"


def test_checkpoint_is_written_acked_and_announced_with_no_temporary_file_left(tmp_path):
    trainer, acks, events = gated_run(tmp_path, 20, [("checkpoint", {"tag": "mid"})])
    ack = acks["checkpoint"]
    assert ack.ok and ack.result["step"] == 3
    path = Path(ack.result["path"])
    assert path.exists() and path.name == "ep0-ba3-mid.pt"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left
    saved = [(ts, d) for topic, ts, d in events if topic == "checkpoint_saved"]
    assert len(saved) == 1 and saved[0][1]["path"] == str(path) and saved[0][0][1] == 3
    order = [t for t, ts, _ in events if ts[1] == 3]
    assert order.index("batch_checkpoint") < order.index("checkpoint_saved")
    assert trainer.timestamp.batch == 24  # training went on


def test_a_process_killed_inside_a_checkpoint_write_leaves_the_checkpoint_before_it_whole(spawn, tmp_path):
    child = spawn("killed_mid_write", "checkpoint", tmp_path)
    first = Path(child.line(timeout=60)["first"])
    inside = child.line(timeout=60)["inside"]  # half of the new one is on disk
    child.popen.kill()
    assert child.wait() == -9
    assert Path(inside) != first  # the half-written bytes went to a file of their own
    assert torch.load(first, weights_only=True)["version"].item() == 1  # the old one, whole
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".pt") == [first.name]


def test_unwritable_checkpoint_folder_fails_cleanly_and_training_goes_on(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the checkpoint folder should be")
    trainer, acks, _ = gated_run(tmp_path, 20, [("checkpoint", {})], save_folder=blocker / "ckpt")
    assert not acks["checkpoint"].ok and "cannot write" in acks["checkpoint"].error
    assert trainer.timestamp.batch == 24
    assert blocker.read_text().startswith("a file")


def test_a_bad_checkpoint_filename_is_refused_alone_and_the_request_beside_it_is_written(tmp_path):
    trainer, acks, events = gated_run(tmp_path, 20, [("checkpoint", {"filename": "../evil.pt"}, "bad"),
                                                     ("checkpoint", {"tag": "good"}, "good")])
    bad, good = acks["bad"], acks["good"]
    assert not bad.ok and bad.error == ("checkpoint filename '../evil.pt' must be a plain file name "
                                        "(letters, digits, '.', '-', '_')")
    assert good.ok and good.result["step"] == 3 and Path(good.result["path"]).name == "ep0-ba3-good.pt"
    saved = [d for topic, _, d in events if topic == "checkpoint_saved"]
    assert [(d["tag"], len(d["requested_by"])) for d in saved] == [("good", 1)]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["ep0-ba3-good.pt"]
    assert not (tmp_path / "evil.pt").exists() and trainer.timestamp.batch == 24


def final_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}


def test_halted_run_resumed_from_its_checkpoint_matches_an_uninterrupted_run_bit_for_bit(tmp_path):
    reference = Trainer(mlp(), loader(dataset=data(64), batch_size=8), "3ep", loss_fn=F.cross_entropy,
                        seed=7, run_dir=tmp_path / "ref", publish=False)
    reference.fit()
    want = final_weights(reference)

    # stop in the middle of epoch 2 (item 75 is in batch 10 = epoch 1, batch 2 of 8)
    halted, acks, _ = gated_run(tmp_path / "b", 75, [("checkpoint", {"tag": "resume"}), ("halt", {})])
    assert acks["halt"].result["step"] == 10 and acks["checkpoint"].result["step"] == 10
    assert halted.timestamp.batch_in_epoch == 2
    assert not any(torch.equal(want[k], v) for k, v in final_weights(halted).items() if v.ndim)

    resumed = Trainer(mlp(), loader(dataset=data(64), batch_size=8), "3ep", loss_fn=F.cross_entropy,
                      seed=7, run_dir=tmp_path / "resumed", load_path=acks["checkpoint"].result["path"],
                      publish=False)
    assert resumed.timestamp.batch == 10
    resumed.fit()
    assert resumed.timestamp.batch == 24
    got = final_weights(resumed)
    assert all(torch.equal(want[k], got[k]) for k in want), "resumed weights differ from uninterrupted"


@pytest.mark.parametrize("op", ["halt", "checkpoint"])
def test_requests_after_the_last_batch(tmp_path, op):
    trainer = Trainer(mlp(), loader(16, 8), "1ep", loss_fn=F.cross_entropy, run_dir=tmp_path / "run")
    trainer.fit()
    out: dict = {}
    thread = ask(trainer.control.endpoint, op, {}, out)
    deadline = time.monotonic() + 10
    while trainer.control.stats.received < 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    trainer.close()
    thread.join(10)
    if op == "halt":  # nothing is left to stop
        assert not out[op].ok and "finished" in out[op].error
    else:  # the final weights are still saved
        assert out[op].ok and out[op].result["step"] == 2 and Path(out[op].result["path"]).exists()


# -------------------- guarantees at their edges --------------------
# Folded from test_trainer_control_guarantees.py (marked `guarantee`: mutation/*.toml select them).
# The trainer's side of the control path at its edges (tests that kill mutants of
# trainer/control.py and trainer/checkpoint.py): requests read at one batch get a file
# each, each acked with its own, the totals the events carry count every request
# and every save (a late joiner gets only the latest of each), and a checkpoint asked
# right after a halt or a refused request is not lost with it.


@pytest.mark.guarantee
def test_two_checkpoint_requests_at_one_batch_get_a_file_each_and_every_total_counts_them(tmp_path):
    trainer, acks, events = gated_run(tmp_path, 20, [("checkpoint", {"tag": "a"}, "a"),
                                                     ("checkpoint", {"tag": "b"}, "b")])
    a, b = acks["a"], acks["b"]
    assert a.ok and b.ok and a.result["step"] == b.result["step"] == 3
    assert (Path(a.result["path"]).name, Path(b.result["path"]).name) == ("ep0-ba3-a.pt", "ep0-ba3-b.pt")
    requests = [d for topic, _, d in events if topic == "control_request"]
    assert [d["count"] for d in requests] == [1, 2]
    saved = [d for topic, _, d in events if topic == "checkpoint_saved"]  # in the requests' arrival order
    assert [d["count"] for d in saved] == [1, 2]
    owner = {a.result["path"]: a.client, b.result["path"]: b.client}
    assert sorted(owner) == sorted(d["path"] for d in saved)
    assert all([client for client, _ in d["requested_by"]] == [owner[d["path"]]] for d in saved)
    assert sorted(p.name for p in Path(a.result["path"]).parent.iterdir()) == ["ep0-ba3-a.pt", "ep0-ba3-b.pt"]
    assert trainer.timestamp.batch == 24  # training went on


@pytest.mark.guarantee
@pytest.mark.parametrize("first", [("halt", {"reason": "enough"}), ("checkpoint", {"filename": "../x.pt"})],
                         ids=["halt", "refused-checkpoint"])
def test_a_checkpoint_asked_after_a_halt_or_a_refused_request_at_the_same_batch_is_still_written(
        tmp_path, first):
    # `first` arrives first, the checkpoint after it; both while batch 3 loads
    trainer, acks, _ = gated_run(tmp_path, 20, [(*first, "first"), ("checkpoint", {"tag": "last"}, "last")])
    if first[0] == "halt":
        assert acks["first"].ok and acks["first"].result["step"] == 3
    else:  # refused, by the trainer or before it by the server (either way, alone)
        assert not acks["first"].ok and "must be a plain file name" in acks["first"].error
    assert acks["last"].ok and acks["last"].result["step"] == 3
    assert Path(acks["last"].result["path"]).name == "ep0-ba3-last.pt"
    assert trainer.timestamp.batch == (3 if first[0] == "halt" else 24)
