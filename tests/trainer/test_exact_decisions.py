"""Decisions taken at epoch and eval boundaries take effect at exactly the step where
Composer's in-process callbacks take them, through real worker processes, with both
cores busy: the same stop step and the same checkpoints on every run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from helpers.trainers import loader

from offloop.trainer import ConfigError, Trainer
from offloop.workers import Callback
from offloop.workers.callbacks import CheckpointSaver, EarlyStopper, ThresholdStopper

BUSY = "while True: pass"


@pytest.fixture
def busy_cores():
    """Both cores busy for the whole test: two spinning processes, stopped by pid."""
    spinners = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(2)]
    yield
    for spinner in spinners:
        spinner.kill()
        spinner.wait(timeout=10)


def _frozen_trainer(tmp_path: Path, callbacks: list, max_duration: str, name: str) -> Trainer:
    """4 batches an epoch, an eval every epoch, and a learning rate of 0: the accuracy
    never improves, so Composer's EarlyStopper(patience=2) decides after epoch 4's eval."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    return Trainer(model, loader(32, 8, shuffle=False), max_duration, loss_fn=F.cross_entropy,
                   optimizers=torch.optim.SGD(model.parameters(), lr=0.0),
                   eval_dataloader=loader(16, 8, shuffle=False), eval_interval=1,
                   eval_metrics=torchmetrics.classification.MulticlassAccuracy(num_classes=3),
                   callbacks=callbacks, run_dir=tmp_path / name, seed=3)


def _names(trainer: Trainer) -> list[str]:
    return [Path(path).name for path in trainer.checkpoints]


def test_early_stopper_stops_at_composers_batch_on_every_run_with_the_cores_busy(tmp_path, busy_cores):
    for run in range(2):
        stopper = EarlyStopper(monitor="MulticlassAccuracy", dataloader_label="eval", patience=2)
        with _frozen_trainer(tmp_path, [stopper], "20ep", f"run{run}") as trainer:
            trainer.fit()
            assert trainer.timestamp.batch == 16, f"run {run}"
            assert trainer.stopped_by["step"] == 16 and trainer.stopped_by["reason"].startswith("EarlyStopper")


def test_checkpoint_saver_saves_at_each_epoch_boundary_with_the_cores_busy(tmp_path, busy_cores):
    saver = CheckpointSaver(save_interval="1ep")
    with _frozen_trainer(tmp_path, [saver], "3ep", "run") as trainer:
        trainer.fit()
        assert _names(trainer) == ["ep1-ba4.pt", "ep2-ba8.pt", "ep3-ba12.pt"]
        for path in trainer.checkpoints:
            state = torch.load(path, weights_only=True)
            assert state["timestamp"]["batch"] == int(Path(path).stem.split("-ba")[1])


def test_a_batch_interval_saves_at_those_batches_and_waits_nowhere_else(tmp_path):
    saver = CheckpointSaver(save_interval="3ba")
    with _frozen_trainer(tmp_path, [saver], "10ba", "run") as trainer:
        trainer.fit()
        assert _names(trainer) == ["ep0-ba3.pt", "ep1-ba6.pt", "ep2-ba9.pt"]
        assert len(trainer.services.decisions.waits) == 3  # one wait per save, none at the other batches


def test_stopper_and_saver_together_stop_and_save_where_composer_would(tmp_path):
    callbacks = [EarlyStopper(monitor="MulticlassAccuracy", dataloader_label="eval", patience=2),
                 CheckpointSaver(save_interval="1ep")]
    with _frozen_trainer(tmp_path, callbacks, "20ep", "run") as trainer:
        trainer.fit()
        assert trainer.timestamp.batch == 16
        assert _names(trainer) == ["ep1-ba4.pt", "ep2-ba8.pt", "ep3-ba12.pt", "ep4-ba16.pt"]


def test_threshold_stopper_on_the_training_loss_stops_at_the_epoch_end_it_judged(tmp_path):
    stopper = ThresholdStopper(monitor="loss", dataloader_label="train", threshold=1e9)
    with _frozen_trainer(tmp_path, [stopper], "20ep", "run") as trainer:
        trainer.fit()
        assert trainer.timestamp.batch == 4 and trainer.stopped_by["step"] == 4


class DecidesAtEpochEnd(Callback):
    """A user's callback that declares where it decides: halts at epoch 2's end."""

    def decides_on(self):
        return {"epoch_end": None}

    def epoch_end(self, state, logger) -> None:
        if state.timestamp.epoch == 2:
            self.halt("enough")


class DecidesWithoutHandling(Callback):
    """Declares a decision point it has no method for: the worker still answers it."""

    def decides_on(self):
        return {"epoch_checkpoint": "2ep"}


def test_a_users_callback_that_declares_its_decisions_stops_exactly(tmp_path):
    with _frozen_trainer(tmp_path, [DecidesAtEpochEnd(), DecidesWithoutHandling()], "20ep", "run") as trainer:
        trainer.fit()
        assert trainer.timestamp.batch == 8 and trainer.stopped_by["client"].startswith("DecidesAtEpochEnd")
        # epoch_end at epochs 1 and 2, and epoch_checkpoint at epoch 2
        assert len(trainer.services.decisions.waits) == 3


class Hangs(Callback):
    def decides_on(self):
        return {"epoch_end": None}

    def epoch_end(self, state, logger) -> None:
        import time

        time.sleep(30)


def test_a_worker_that_does_not_answer_costs_the_timeout_once_and_is_reported(tmp_path, caplog):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    with Trainer(model, loader(32, 8), "3ep", loss_fn=F.cross_entropy, callbacks=[Hangs()],
                 run_dir=tmp_path / "run", decision_timeout=0.5, worker_shutdown_timeout=1) as trainer:
        trainer.fit()
        assert trainer.timestamp.batch == 12
        assert len(trainer.services.decisions.waits) == 1 and 0.5 <= trainer.services.decisions.waits[0] < 5
    assert sum("did not answer epoch_end within 0.5s" in r.getMessage() for r in caplog.records) == 1


class BadDeclaration(Callback):
    def __init__(self, declared) -> None:
        self.declared = declared

    def decides_on(self):
        return self.declared


@pytest.mark.parametrize(("declared", "says"), [
    ({"batch_end": None}, "decisions can be awaited at"),
    ({"batch_checkpoint": None}, "must give 'batch_checkpoint' an interval in batches"),
    ({"batch_checkpoint": "1ep"}, "must be a positive number of batches"),
    ({"epoch_end": "often"}, "decides_on()['epoch_end']"),
    ([("epoch_end", None)], "must return a dict"),
])
def test_a_bad_declaration_is_refused_before_training_naming_the_callback(tmp_path, declared, says):
    with pytest.raises(ConfigError, match="BadDeclaration") as raised:
        Trainer(torch.nn.Linear(8, 3), loader(16, 8), "1ep", loss_fn=F.cross_entropy,
                callbacks=[BadDeclaration(declared)], run_dir=tmp_path / "run")
    assert says in str(raised.value)


def test_pytorch_accelerated_early_stopping_stops_at_the_epoch_it_judged(tmp_path):
    from offloop.workers.callbacks import EarlyStoppingCallback

    stopper = EarlyStoppingCallback(early_stopping_patience=2, watch_metric="eval_loss_epoch")
    with _frozen_trainer(tmp_path, [stopper], "20ep", "run") as trainer:
        trainer.fit()
        # the first epoch sets the best; the second and third bring no improvement
        assert trainer.timestamp.batch == 12 and trainer.stopped_by["step"] == 12


def test_pytorch_accelerated_save_best_model_saves_each_improving_epoch_the_last_included(tmp_path):
    from offloop.workers.callbacks import SaveBestModelCallback

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    saver = SaveBestModelCallback(save_path=str(tmp_path / "best.pt"), watch_metric="train_loss_epoch")
    with Trainer(model, loader(32, 8, shuffle=False), "3ep", loss_fn=F.cross_entropy,
                 optimizers=torch.optim.SGD(model.parameters(), lr=0.1), callbacks=[saver],
                 run_dir=tmp_path / "run", seed=3) as trainer:
        trainer.fit()
        assert [torch.load(p, weights_only=True)["timestamp"]["batch"] for p in trainer.checkpoints] == [4, 8, 12]
