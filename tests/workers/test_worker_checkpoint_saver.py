"""CheckpointSaver on real runs: what it asks for and when, which files the trainer wrote
for it, which it kept (num_checkpoints_to_keep), and where `latest` points."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
from helpers.harness import MemoryLog, Paced, run_with_worker

from offloop.bus import Event
from offloop.workers.callbacks import CheckpointSaver

BATCHES = 8  # per epoch: the harness trains on 64 samples in batches of 8


def run(saver, tmp_path, max_duration):
    log = MemoryLog()
    trainer, _ = run_with_worker([saver], tmp_path, max_duration=max_duration, model=Paced(),
                                 destinations=[log])
    assert saver.wait(5.0)
    return trainer, log


def saved_step(path) -> int:
    return torch.load(path, weights_only=True)["timestamp"]["batch"]


def test_saves_every_epoch_keeps_the_newest_two_and_points_latest_at_the_newest(tmp_path):
    saver = CheckpointSaver(save_interval="1ep", num_checkpoints_to_keep=2)
    trainer, log = run(saver, tmp_path, "4ep")
    saves = saver.saves
    # decided at the ends of epochs 1-3; at the end of epoch 4 the run is over
    assert [(s.asked_at.epoch, s.asked_at.batch) for s in saves] == [(e, e * BATCHES) for e in (1, 2, 3)]
    for save in saves:
        assert save.error is None
        assert save.asked_at.batch < save.step <= save.asked_at.batch + BATCHES  # next boundary
    assert trainer.checkpoints == [s.path for s in saves]  # the trainer wrote all three
    assert not Path(saves[0].path).exists()  # rotated out
    assert saver.saved_checkpoints == [saves[1].path, saves[2].path]
    assert all(saved_step(s.path) == s.step for s in saves[1:])
    latest = trainer.save_folder / "latest"
    assert latest.is_symlink() and not os.path.isabs(os.readlink(latest))
    assert latest.resolve() == Path(saves[2].path).resolve()
    assert any("not asking for a checkpoint at epoch 4" in t for t in log.texts)
    assert any(t.startswith(f"CheckpointSaver: saved {saves[2].path}") for t in log.texts)


def test_batch_interval_with_its_own_folder_file_names_and_one_kept(tmp_path):
    kept = tmp_path / "kept"
    saver = CheckpointSaver(folder=str(kept), filename="ckpt-ba{batch}.pt",
                            latest_filename="latest-{run_name}.pt", save_interval="5ba",
                            num_checkpoints_to_keep=1)
    trainer, _ = run(saver, tmp_path, "3ep")
    saves = saver.saves
    assert [s.asked_at.batch for s in saves] == [5, 10, 15, 20]
    assert [Path(s.path) for s in saves] == [kept / f"ckpt-ba{b}.pt" for b in (5, 10, 15, 20)]
    assert all(s.asked_at.batch < s.step for s in saves)
    assert sorted(p.name for p in kept.iterdir()) == ["ckpt-ba20.pt", f"latest-{trainer.run_name}.pt"]
    assert (kept / f"latest-{trainer.run_name}.pt").resolve() == (kept / "ckpt-ba20.pt").resolve()
    assert saved_step(kept / "ckpt-ba20.pt") == saves[-1].step
    assert not list(trainer.save_folder.glob("ckpt-*"))  # moved out of the trainer's folder


def test_callable_interval_and_nothing_kept(tmp_path):
    calls = []

    def at_epoch_2(state, event):
        calls.append(event)
        return event == Event.EPOCH_CHECKPOINT and state.timestamp.epoch == 2

    saver = CheckpointSaver(save_interval=at_epoch_2, num_checkpoints_to_keep=0)
    trainer, _ = run(saver, tmp_path, "3ep")
    assert [(s.asked_at.epoch, s.asked_at.batch) for s in saver.saves] == [(2, 2 * BATCHES)]
    assert calls.count(Event.EPOCH_CHECKPOINT) == 3 and calls.count(Event.BATCH_CHECKPOINT) == 3 * BATCHES
    assert len(trainer.checkpoints) == 1 and not Path(trainer.checkpoints[0]).exists()
    assert saver.saved_checkpoints == [] and not (trainer.save_folder / "latest").exists()


def test_a_saver_pickles_for_its_worker_process():
    saver = CheckpointSaver(save_interval="3ba", num_checkpoints_to_keep=2)
    copy = pickle.loads(pickle.dumps(saver))
    assert (copy.save_interval.interval, copy.num_checkpoints_to_keep) == (saver.save_interval.interval, 2)
    assert copy.wait(0.1) and copy.saves == []


def test_options_are_checked():
    with pytest.raises(ValueError, match="weights_only"):
        CheckpointSaver(weights_only=True)
    with pytest.raises(ValueError, match="num_checkpoints_to_keep"):
        CheckpointSaver(num_checkpoints_to_keep=-2)
    with pytest.raises(ValueError, match="save_interval"):
        CheckpointSaver(save_interval="every epoch")
    with pytest.raises(ValueError, match="filename"):
        CheckpointSaver(filename="ep{epoch}-{step}.pt")
