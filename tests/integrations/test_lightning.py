"""Lightning's Trainer publishing to offloop: events in order to a worker's callback, a halt
and a checkpoint request over the control channel, an EarlyStopper's halt at the eval it
judged, and run.json for `offloop ls` (real Lightning, CPU, one process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")

import torch  # noqa: E402
from helpers.callbacks import Recorder  # noqa: E402
from helpers.lightning_module import AskAt, Classifier, loader, trainer  # noqa: E402

from offloop.bus import read_run_info  # noqa: E402
from offloop.callbacks import EarlyStopper  # noqa: E402
from offloop.integrations.lightning import OffloopCallback  # noqa: E402


def test_a_lightning_run_fires_composers_events_to_a_worker_and_marks_run_json(tmp_path):
    offloop = OffloopCallback([Recorder(str(tmp_path / "seen.json"))], run_dir=tmp_path / "run")
    pl_trainer = trainer([offloop], max_epochs=2)
    pl_trainer.fit(Classifier(), loader(64), loader(16))
    seen = json.loads((tmp_path / "seen.json").read_text())
    topics = [topic for topic, _ in seen]
    assert topics[:4] == ["init", "before_load", "after_load", "fit_start"]
    assert topics[-1] == "fit_end"
    assert topics.count("batch_end") == 16 and topics.count("epoch_end") == 2 and topics.count("eval_end") == 2
    # one step's events in Composer's order (after_forward and before_loss have no Lightning hook)
    first = topics.index("batch_start")
    assert topics[first:first + 8] == ["batch_start", "before_train_batch", "before_forward", "after_loss",
                                       "before_backward", "after_backward", "after_train_batch", "batch_end"]
    batch_ends = [counters for topic, counters in seen if topic == "batch_end"]
    assert [c[1] for c in batch_ends] == list(range(1, 17))  # the batch counter, from Lightning's steps
    assert [counters[0] for topic, counters in seen if topic == "epoch_end"] == [1, 2]
    # each epoch's end in Composer's order: epoch_end, its evaluation, epoch_checkpoint
    end = topics.index("epoch_end")
    assert topics[end + 1:end + 3] == ["eval_before_all", "eval_start"]
    assert topics.index("epoch_checkpoint") == topics.index("eval_after_all") + 1
    info = read_run_info(tmp_path / "run")
    assert info.finished is True and info.extra["progress"]["batch"] == 16
    assert info.extra["config"]["host_trainer"].startswith("lightning")


def test_a_second_fit_with_the_same_callback_is_a_run_of_its_own(tmp_path):
    """The run ends with its fit (teardown closes it); another fit with the same callback
    starts a new run, with workers of its own, rather than publishing into a closed one
    (which raised from the publisher's closed socket inside the training loop)."""
    offloop = OffloopCallback([Recorder(str(tmp_path / "seen.json"))], run_dir=tmp_path / "run")
    assert not offloop.run.wants("batch_end")  # not started: nothing is wanted
    offloop.run.emit("batch_start", {"batch_size": 8})  # and nothing is published
    trainer([offloop], max_epochs=1).fit(Classifier(), loader(64))
    first = read_run_info(tmp_path / "run")
    assert offloop.run.closed and not offloop.run.wants("batch_end")
    offloop.run.emit("batch_start", {"batch_size": 8})  # closed: nothing is held
    assert len(offloop.run.publisher.held.queue) == 0
    trainer([offloop], max_epochs=2).fit(Classifier(), loader(64))
    second = read_run_info(tmp_path / "run")
    assert second.run_id != first.run_id and second.finished is True
    seen = json.loads((tmp_path / "seen.json").read_text())  # the second run's worker wrote it
    batches = [counters[1] for topic, counters in seen if topic == "batch_end"]
    assert batches == list(range(1, 17)) and [t for t, _ in seen][-1] == "fit_end"


def test_a_halt_sets_should_stop_at_the_batch_it_is_acked_at(tmp_path):
    offloop = OffloopCallback(run_dir=tmp_path / "run")
    asker = AskAt(offloop, 5, "halt", {"reason": "enough"})
    pl_trainer = trainer([asker, offloop], max_epochs=5)
    pl_trainer.fit(Classifier(), loader(64))
    ack = asker.ack()
    assert ack.ok, ack
    assert ack.result["step"] == 5 and pl_trainer.global_step == 5  # stopped after the batch it was read at
    stopped_by = read_run_info(tmp_path / "run").extra["stopped_by"]
    assert stopped_by["reason"] == "enough" and stopped_by["step"] == 5


def test_a_checkpoint_request_is_written_by_lightning_and_acked_with_its_path(tmp_path):
    offloop = OffloopCallback(run_dir=tmp_path / "run")
    asker = AskAt(offloop, 3, "checkpoint", {"tag": "mine"})
    pl_trainer = trainer([asker, offloop], max_epochs=1)
    pl_trainer.fit(Classifier(), loader(64))
    ack = asker.ack()
    assert ack.ok, ack
    path = ack.result["path"]
    assert path.endswith("ep0-ba3-mine.ckpt") and ack.result["step"] == 3
    saved = torch.load(path, weights_only=False)
    assert saved["global_step"] == 3 and "net.0.weight" in saved["state_dict"]
    # Lightning resumes from it
    resumed = trainer([], max_epochs=1)
    resumed.fit(Classifier(), loader(64), ckpt_path=path)
    assert resumed.global_step == 8


def test_a_requested_checkpoint_never_writes_over_one_that_exists(tmp_path):
    existing = tmp_path / "run" / "checkpoints" / "ep0-ba3-mine.ckpt"
    existing.parent.mkdir(parents=True)
    existing.write_bytes(b"someone else's")
    offloop = OffloopCallback(run_dir=tmp_path / "run")
    asker = AskAt(offloop, 3, "checkpoint", {"tag": "mine"})
    trainer([asker, offloop], max_epochs=1).fit(Classifier(), loader(64))
    ack = asker.ack()
    assert ack.ok and ack.result["path"].endswith("ep0-ba3-mine-2.ckpt"), ack
    assert existing.read_bytes() == b"someone else's"
    assert torch.load(ack.result["path"], weights_only=False)["global_step"] == 3


def test_an_early_stopper_halts_at_the_eval_it_judged(tmp_path):
    # val_loss never improves: patience 1 (epoch) is exceeded at the third eval, as in Composer
    offloop = OffloopCallback([EarlyStopper("val_loss", "eval", patience=1)], run_dir=tmp_path / "run")
    pl_trainer = trainer([offloop], max_epochs=10)
    pl_trainer.fit(Classifier(flat_val=True), loader(64), loader(16))
    assert pl_trainer.current_epoch == 3 and pl_trainer.global_step == 24
    assert "EarlyStopper" in read_run_info(tmp_path / "run").extra["stopped_by"]["reason"]


def test_bad_arguments_and_a_missing_lightning_are_named(tmp_path):
    from offloop.trainer.errors import ConfigError

    with pytest.raises(ConfigError, match="callbacks must be a list"):
        OffloopCallback(EarlyStopper("val_loss", "eval"))
    with pytest.raises(ConfigError, match="burst_interval"):
        OffloopCallback(burst_interval=-1)
    code = ("import sys; sys.modules['lightning'] = sys.modules['lightning.pytorch'] = None; "
            "sys.modules['pytorch_lightning'] = None; import offloop.integrations.lightning")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "pip install 'offloop[lightning]'" in result.stderr


def test_two_ddp_ranks_save_the_requested_checkpoint_and_halt_at_the_same_batch(tmp_path):
    """Lightning's DDP over gloo, two processes: rank 0 holds the control server; the
    checkpoint (batch 2) and the halt (batch 4) are agreed by both ranks at one batch."""
    script = str(Path(__file__).parents[1] / "programs" / "ddp_lightning.py")
    result = subprocess.run([sys.executable, script, str(tmp_path)], capture_output=True, text=True, timeout=240,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert [r["global_step"] for r in ranks] == [4, 4] and [r["batch"] for r in ranks] == [4, 4]
    acks = ranks[0]["acks"]
    assert acks["halt"]["ok"] and acks["halt"]["result"]["step"] == 4
    assert acks["checkpoint"]["ok"] and acks["checkpoint"]["result"]["step"] == 2
    saved = torch.load(acks["checkpoint"]["result"]["path"], weights_only=False)
    assert saved["global_step"] == 2
    info = read_run_info(tmp_path / "run")
    assert info.world_size == 2 and len(info.ranks) == 2 and info.finished


def test_a_run_that_cannot_start_fails_the_fit_before_training_and_leaves_nothing_open(tmp_path):
    from offloop.trainer.errors import ConfigError

    offloop = OffloopCallback(run_dir=tmp_path / "run", keys=tmp_path / "no-such-keys")
    with pytest.raises(ConfigError, match="no-such-keys"):
        trainer([offloop]).fit(Classifier(), loader(64))
    assert not offloop.run.started and not (tmp_path / "run" / "run.json").exists()
