"""Composer's event order, seen by a callback in a worker process from init to fit_end."""

from __future__ import annotations

import json
import os

import msgpack
import pytest
import torch
import torchmetrics
from helpers.callbacks import BatchCounter, Crasher, ExitOnSecondFit, LossProbe, NiceProbe, Recorder
from helpers.trainers import loader, mlp

from offloop.bus import Subscriber
from offloop.bus.timestamp import FIELDS
from offloop.bus.wire import decode_burst
from offloop.trainer import Trainer

MICRO = ["before_forward", "after_forward", "before_loss", "after_loss", "before_backward",
         "after_backward"]


def eval_block(batches: int) -> list[str]:
    per_batch = ["eval_batch_start", "eval_before_forward", "eval_after_forward", "eval_batch_end"]
    return ["eval_before_all", "eval_start", *per_batch * batches, "eval_end", "eval_after_all"]


def expected(epochs: int, batches: int, accum: int, batch_eval_every: int, eval_batches: int):
    """Composer's pseudocode, written out: what the trainer must fire, in order."""
    seq = ["init", "before_load", "after_load", "fit_start", "iteration_start"]
    done = 0
    for _ in range(epochs):
        seq.append("epoch_start")
        for _ in range(batches):
            seq += ["before_dataloader", "after_dataloader", "batch_start", "before_train_batch"]
            seq += MICRO * accum
            seq += ["after_train_batch", "batch_end"]
            done += 1
            if done % batch_eval_every == 0:
                seq += eval_block(eval_batches)
            seq.append("batch_checkpoint")
        seq += ["before_dataloader", "epoch_end", *eval_block(eval_batches), "epoch_checkpoint"]
    return seq + ["fit_end"]


def test_exact_event_sequence_with_grad_accum_and_batch_and_epoch_eval(tmp_path):
    record = tmp_path / "events.json"
    trainer = Trainer(
        mlp(), loader(32, 8), "2ep", loss_fn=torch.nn.functional.cross_entropy, grad_accum=2,
        eval_dataloader={"val": loader(16, 8, shuffle=False), "test": loader(8, 8, shuffle=False)},
        eval_interval={"val": "3ba", "test": "1ep"},
        eval_metrics=torchmetrics.classification.MulticlassAccuracy(num_classes=3),
        callbacks=[Recorder(str(record))], run_dir=tmp_path / "run",
    )
    trainer.fit()
    trainer.close()
    seen = json.loads(record.read_text())
    topics = [topic for topic, _ in seen]
    # the 'val' evaluation (2 batches) every 3 batches; 'test' (1 batch) after each epoch
    want = expected(epochs=2, batches=4, accum=2, batch_eval_every=3, eval_batches=2)
    want = _epoch_eval_is_test(want)
    assert topics == want
    batch_ends = [ts for topic, ts in seen if topic == "batch_end"]
    assert [ts[1] for ts in batch_ends] == list(range(1, 9))  # batch counter after each step
    assert [ts[0] for topic, ts in seen if topic == "epoch_end"] == [1, 2]


def _epoch_eval_is_test(seq: list[str]) -> list[str]:
    """In `expected`, epoch-level eval blocks have 2 batches; 'test' has 1."""
    out, i = [], 0
    while i < len(seq):
        if seq[i] == "epoch_end":
            out += ["epoch_end", *eval_block(1)]
            i += 1 + len(eval_block(2))
        else:
            out.append(seq[i])
            i += 1
    return out


def test_a_crashing_callback_never_stops_training_or_its_neighbours(tmp_path):
    counts = tmp_path / "counts.json"
    trainer = Trainer(mlp(), loader(32, 8), "3ep", loss_fn=torch.nn.functional.cross_entropy,
                      callbacks=[Crasher(), BatchCounter(str(counts))], run_dir=tmp_path / "run")
    trainer.fit()
    trainer.close()
    assert trainer.timestamp.batch == 12
    assert json.loads(counts.read_text()) == {"batch_end": 12}


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_after_loss_holds_each_microbatch_loss_and_batch_end_the_step_loss(grad_accum, tmp_path):
    """after_loss: the microbatch's own loss; batch_end: the step's, each microbatch
    weighted by its share of the batch (one microbatch: the same number, read once)."""
    probe = tmp_path / "losses.json"
    trainer = Trainer(mlp(), loader(48, 12), "1ep", loss_fn=torch.nn.functional.cross_entropy,
                      grad_accum=grad_accum, callbacks=[LossProbe(str(probe))], run_dir=tmp_path / "run")
    trainer.fit()
    trainer.close()
    seen = json.loads(probe.read_text())
    assert len(seen) == 4 * (grad_accum + 1)
    for step in range(4):
        micro = [loss for event, batch, loss in seen if event == "after_loss" and batch == step]
        [step_loss] = [loss for event, batch, loss in seen if event == "batch_end" and batch == step + 1]
        assert len(micro) == grad_accum and all(isinstance(x, float) for x in micro + [step_loss])
        assert step_loss == pytest.approx(sum(micro) / grad_accum, rel=1e-6)
    assert len({loss for event, _, loss in seen if event == "after_loss"}) == 4 * grad_accum


def test_workers_live_through_every_fit_and_a_death_in_a_later_fit_is_reported(tmp_path):
    """fit() twice: each fit_end carries its number, close() waits for the last one, and a
    worker dying in the second fit is a crash (reported, restarted), not a clean end. The
    dying callback has a process of its own: the Recorder's, shared by default, lives on."""
    record = tmp_path / "events.json"
    trainer = Trainer(mlp(), loader(32, 4), "1ep", loss_fn=torch.nn.functional.cross_entropy,
                      callbacks=[ExitOnSecondFit().in_own_process(), Recorder(str(record))],
                      run_dir=tmp_path / "run",
                      worker_shutdown_timeout=5)
    trainer.fit()
    assert not trainer.workers.crashes
    trainer.fit(duration="2ep")
    trainer.close()
    assert trainer.timestamp.batch == 16
    assert len(trainer.workers.crashes) == 1 and "exited with code 7" in trainer.workers.crashes[0]
    assert trainer.workers.restarts == 1
    seen = [event for event, _ in json.loads(record.read_text())]
    assert seen.count("fit_start") == 2 and seen.count("fit_end") == 2 and seen.count("batch_end") == 16
    assert seen[-1] == "fit_end"
    recorder = trainer.workers.workers[0]  # the shared process comes first
    assert recorder.names == ["Recorder"]
    assert recorder.fits_seen == 2 and recorder.report["fit"] == 2


@pytest.mark.parametrize("nice", [None, 3, 0])
def test_callback_workers_run_at_a_lower_cpu_priority_than_training(nice, tmp_path):
    """A worker sharing a CPU with the training loop yields to it: every thread of the
    worker process (ZeroMQ's too) runs `worker_nice` (10 by default) above the trainer."""
    probe = tmp_path / "nice.json"
    extra = {} if nice is None else {"worker_nice": nice}
    trainer = Trainer(mlp(), loader(32, 2), "1ep", loss_fn=torch.nn.functional.cross_entropy,
                      callbacks=[NiceProbe(str(probe))], run_dir=tmp_path / "run", **extra)
    trainer.fit()
    trainer.close()
    want = min(19, os.nice(0) + (10 if nice is None else nice))
    seen = json.loads(probe.read_text())
    assert seen["nice"] == want
    assert len(seen["threads"]) >= 2 and set(seen["threads"]) == {want}


def test_load_eval_and_predict_fire_their_events_in_order(tmp_path):
    first = Trainer(mlp(), loader(16, 8), "1ep", loss_fn=torch.nn.functional.cross_entropy,
                    run_dir=tmp_path / "first", publish=False)
    first.fit()
    checkpoint = first.save_checkpoint(tag="start")
    record = tmp_path / "events.json"
    trainer = Trainer(
        mlp(), loader(16, 8), "2ep", loss_fn=torch.nn.functional.cross_entropy,
        eval_dataloader=loader(16, 8, shuffle=False), load_path=checkpoint,
        eval_metrics=torchmetrics.classification.MulticlassAccuracy(num_classes=3),
        callbacks=[Recorder(str(record))], run_dir=tmp_path / "run",
    )
    results = trainer.eval()
    outputs = trainer.predict(loader(16, 8, shuffle=False))
    trainer.close()
    topics = [topic for topic, _ in json.loads(record.read_text())]
    per_eval = ["eval_batch_start", "eval_before_forward", "eval_after_forward", "eval_batch_end"]
    per_predict = ["predict_batch_start", "predict_before_forward", "predict_after_forward",
                   "predict_batch_end"]
    assert topics == ["init", "before_load", "after_load",
                      "eval_standalone_start", "eval_start", *per_eval * 2, "eval_end", "eval_standalone_end",
                      "predict_start", *per_predict * 2, "predict_end"]
    assert trainer.timestamp.batch == 2  # resumed from the checkpoint's step
    assert 0.0 <= results["eval"]["MulticlassAccuracy"] <= 1.0 and "loss" in results["eval"]
    assert len(outputs) == 2 and outputs[0].shape == (8, 3)


def test_a_steps_events_share_their_timestamp_and_a_burst_carries_it_once_each(tmp_path):
    """Timestamp.as_tuple() gives one object for the life of a Timestamp (the trainer moves
    on to a new one at every step), and the publisher keeps an event without a ts that is
    its predecessor's: on the wire a step carries its ts twice (before and after the
    optimizer step), not at every event."""
    ts = Trainer(mlp(), loader(64, 8), "1ba", loss_fn=torch.nn.functional.cross_entropy,
                 run_dir=tmp_path / "run", burst_interval=60.0).timestamp
    assert ts.as_tuple() is ts.as_tuple()
    before = ts.as_tuple()
    after = ts.to_next_batch(8, 0)
    assert after.as_tuple() == (0, 1, 1, 8, 0) and after.as_tuple() is not before
    assert after.as_tuple() is after.as_tuple() and ts.as_tuple() is before
    assert set(after.state_dict()) == set(FIELDS)  # the cached tuple is no counter

    trainer = Trainer(mlp(), loader(64, 8), "8ba", loss_fn=torch.nn.functional.cross_entropy,
                      run_dir=tmp_path / "run2", burst_interval=60.0)
    with Subscriber(trainer.publisher.endpoints["events"], trainer.publisher.endpoints["state"]) as sub:
        sub.connect(join_timeout=10)
        trainer.fit()
        bursts = []
        while sub._sub.poll(2000):
            frames = sub._sub.recv_multipart()
            if frames[0].startswith(b"_burst\0"):
                bursts.append(frames)
            if any(m.topic == "fit_end" for frames in bursts[-1:] for m in decode_burst(frames)):
                break
    trainer.close()
    events = [m for frames in bursts for m in decode_burst(frames)]
    steps = [m for m in events if m.topic == "batch_end"]
    assert [m.ts[1] for m in steps] == list(range(1, 9))
    assert all(m.ts[1] == m.ts[2] and m.ts[3] == 8 * m.ts[1] for m in events if m.topic.startswith("batch_"))
    with_ts = sum(len(entry) == 4 for frames in bursts for entry in msgpack.unpackb(frames[0][7:])[7])
    assert with_ts <= 2 * 8 + 6  # two a step, and a few for init, fit_start, epoch and fit_end
