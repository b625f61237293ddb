"""A callback's state across a resume: its worker keeps `state_dict()` beside every
checkpoint and hands it back to `load_state_dict()` when a Trainer resumes from one, so an
EarlyStopper resumed mid-run stops where the uninterrupted run stops."""

from __future__ import annotations

import json

import torch
from helpers.trainers import small_trainer

from offloop import Callback, log_metrics
from offloop.callbacks import CheckpointSaver, EarlyStopper

BATCHES = 4  # 32 samples in batches of 8
#: the logged score of each epoch: best (lowest) at epoch 3, then no better for 3 epochs
SCORES = [5.0, 4.0, 3.0, 3.5, 3.2, 3.1, 3.3, 2.0, 1.0, 0.5]


class Scored(torch.nn.Module):
    """Logs the score of the epoch it is in (counted in a buffer: checkpointed with the model)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(8, 3)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        if self.training:
            log_metrics({"aux/loss": SCORES[int(self.steps) // BATCHES]})
            self.steps += 1
        return self.linear(x)


def _trainer(tmp_path, name, duration, **kw):
    return small_trainer(tmp_path, duration, model=Scored(), name=name, seed=1,
                         callbacks=[EarlyStopper("aux/loss", "train", patience=2), *kw.pop("callbacks", [])],
                         **kw)


def test_an_early_stopper_resumed_from_a_checkpoint_stops_where_the_uninterrupted_run_stops(tmp_path, capfd):
    with _trainer(tmp_path, "whole", "10ep") as whole:
        whole.fit()
    assert whole.stopped_by is not None and whole.timestamp.epoch == 6  # 3 epochs past the best

    with _trainer(tmp_path, "first", "4ep", callbacks=[CheckpointSaver(save_interval="1ep")]) as first:
        first.fit()
    checkpoint = first.checkpoints[-1]
    [sidecar] = [p for p in first.save_folder.iterdir() if p.name == f"{checkpoint.rsplit('/', 1)[1]}.callbacks-0.json"]
    saved = json.loads(sidecar.read_text())
    [stopper] = [entry for entry in saved["callbacks"] if entry["name"] == "EarlyStopper"]
    assert stopper["state"]["best"] == 3.0 and stopper["state"]["best_occurred"]["__offloop_timestamp__"]["epoch"] == 3

    with _trainer(tmp_path, "second", "10ep", load_path=checkpoint) as second:
        second.fit()
    assert second.stopped_by is not None
    assert (second.timestamp.epoch, second.timestamp.batch) == (whole.timestamp.epoch, whole.timestamp.batch)
    assert "no callback state beside" not in capfd.readouterr().err


def test_without_its_state_the_resumed_stopper_would_stop_elsewhere(tmp_path, capfd):
    """The test above can fail: a stopper that starts afresh on resume stops later."""
    with _trainer(tmp_path, "first", "4ep", callbacks=[CheckpointSaver(save_interval="1ep")]) as first:
        first.fit()
    checkpoint = first.checkpoints[-1]
    for state in first.save_folder.glob("*.callbacks-*.json"):
        state.unlink()
    with _trainer(tmp_path, "second", "10ep", load_path=checkpoint) as second:
        second.fit()
    assert second.timestamp.epoch != 6
    assert "no callback state beside" in capfd.readouterr().err


class Unsaveable(Callback):
    def state_dict(self):
        return {"lock": object()}


def test_a_state_that_is_not_json_is_reported_once_and_the_others_are_kept(tmp_path, capfd):
    with _trainer(tmp_path, "run", "3ep", callbacks=[Unsaveable(), CheckpointSaver(save_interval="1ep")]) as trainer:
        trainer.fit()
    err = capfd.readouterr().err
    assert err.count("Unsaveable.state_dict() cannot be saved beside checkpoints") == 1
    names = {entry["name"] for p in trainer.save_folder.glob("*.callbacks-0.json")
             for entry in json.loads(p.read_text())["callbacks"]}
    assert names == {"EarlyStopper"}
