"""`log_metrics()` from training code: what a model logs reaches callbacks in their workers
(state.train_metrics, and an evaluation's beside its eval metrics), a stopper can monitor
it, and bad input is one clear error."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from helpers.trainers import loader

from offloop import log_metrics
from offloop.trainer import Trainer, TrainerError
from offloop.workers import Callback
from offloop.workers.callbacks import ThresholdStopper


class Penalised(torch.nn.Module):
    """Logs, at each training forward, a 0-d tensor counting its calls, and in eval a float."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 3)
        self.calls = 0

    def forward(self, x):
        if self.training:
            self.calls += 1
            log_metrics({"aux/calls": torch.tensor(float(self.calls)), "aux/const": 7})
        else:
            log_metrics({"aux/eval_seen": 1.5})
        return self.linear(x)


class Records(Callback):
    def __init__(self, path: str) -> None:
        self.path, self.seen, self.evals = path, [], []

    def batch_end(self, state, logger) -> None:
        self.seen.append([state.timestamp.batch, dict(state.train_metrics)])

    def eval_end(self, state, logger) -> None:
        self.evals.append(dict(state.eval_metrics["eval"]))

    def fit_end(self, state, logger) -> None:
        with open(self.path, "w") as out:
            json.dump({"seen": self.seen, "evals": self.evals}, out)


def test_what_the_model_logs_reaches_the_callbacks_with_its_step(tmp_path):
    record = tmp_path / "record.json"
    with Trainer(Penalised(), loader(32, 8, shuffle=False), "2ep", loss_fn=F.cross_entropy,
                 eval_dataloader=loader(16, 8, shuffle=False), callbacks=[Records(str(record))],
                 run_dir=tmp_path / "run") as trainer:
        trainer.fit()
    seen = json.loads(record.read_text())
    assert seen["seen"] == [[b, {"aux/calls": float(b), "aux/const": 7.0}] for b in range(1, 9)]
    assert [e["aux/eval_seen"] for e in seen["evals"]] == [1.5, 1.5]


def test_a_stopper_monitors_a_logged_metric(tmp_path):
    stopper = ThresholdStopper(monitor="aux/calls", dataloader_label="train", threshold=7.5, comp="gt")
    with Trainer(Penalised(), loader(32, 8, shuffle=False), "10ep", loss_fn=F.cross_entropy,
                 callbacks=[stopper], run_dir=tmp_path / "run") as trainer:
        trainer.fit()
        assert trainer.timestamp.batch == 8  # judged at epoch 2's end, where calls reached 8


def test_bad_values_are_one_clear_error_and_log_nothing(tmp_path):
    with Trainer(torch.nn.Linear(8, 3), loader(16, 8), "1ep", loss_fn=F.cross_entropy,
                 run_dir=tmp_path / "run") as trainer:
        for bad, says in (({"x": torch.ones(3)}, r"tensor of shape \(3,\)"), ({"x": "high"}, "'x' is str"),
                          ({"x": True}, "'x' is bool"), ({"": 1.0}, "non-empty strings"),
                          ([("x", 1.0)], "takes a dict")):
            with pytest.raises(TrainerError, match=says):
                log_metrics(bad)
        with pytest.raises(TrainerError, match="'y' is NoneType"):
            log_metrics({"ok": 1.0, "y": None})
        assert trainer.readings.user_metrics.values == {}  # all or nothing


def test_without_an_open_trainer_it_says_what_is_missing(tmp_path):
    trainer = Trainer(torch.nn.Linear(8, 3), loader(16, 8), "1ep", loss_fn=F.cross_entropy,
                      run_dir=tmp_path / "run")
    trainer.close()
    with pytest.raises(TrainerError, match="log_metrics\\(\\) needs a Trainer"):
        log_metrics({"x": 1.0})


def test_an_older_open_trainer_never_gets_what_the_closed_latest_would_have(tmp_path):
    older = Trainer(torch.nn.Linear(8, 3), loader(16, 8), "1ep", loss_fn=F.cross_entropy, run_dir=tmp_path / "a")
    Trainer(torch.nn.Linear(8, 3), loader(16, 8), "1ep", loss_fn=F.cross_entropy, run_dir=tmp_path / "b").close()
    try:
        with pytest.raises(TrainerError, match="goes to the one built last"):
            log_metrics({"x": 1.0})
        assert older.readings.user_metrics.values == {}
    finally:
        older.close()
