"""`Trainer(loggers=[...])`: Composer's logger classes run in the worker that holds them,
get what Composer's Trainer logs (the loss each step, eval metrics, hyperparameters) and
what callbacks log, and are read back from their real files."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from common import loader
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from offloop import log_metrics
from offloop.loggers import FileLogger, TensorboardLogger
from offloop.trainer import ConfigError, Trainer
from offloop.workers import Callback
from offloop.workers.callbacks import LRMonitor


class Logs(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 3)

    def forward(self, x):
        if self.training:
            log_metrics({"aux": 0.5})
        return self.linear(x)


class OwnProcessLogs(Callback):
    """A callback in a process of its own: its logs stay there (the loggers are in the shared one)."""

    def batch_end(self, state, logger) -> None:
        logger.log_metrics({"elsewhere": 1.0})


def _trainer(tmp_path, loggers, callbacks=()):
    torch.manual_seed(0)
    return Trainer(Logs(), loader(32, 8, shuffle=False), "2ep", loss_fn=F.cross_entropy,
                   eval_dataloader=loader(16, 8, shuffle=False),
                   eval_metrics=torchmetrics.classification.MulticlassAccuracy(num_classes=3),
                   callbacks=list(callbacks), loggers=loggers, run_dir=tmp_path / "run", run_name="logged",
                   hparams={"lr": 0.1, "width": 8}, seed=1)


def test_tensorboard_event_files_hold_the_loss_eval_metrics_callbacks_logs_and_hparams(tmp_path):
    log_dir = tmp_path / "tb"
    with _trainer(tmp_path, [TensorboardLogger(log_dir=str(log_dir))], [LRMonitor()]) as trainer:
        trainer.fit()
        workers = trainer.workers.workers  # the loggers' worker is the shared one
        assert [worker.name for worker in workers] == ["LRMonitor+loggers"]
    events = EventAccumulator(str(log_dir / "logged"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss/train/total", "metrics/train/aux", "metrics/eval/MulticlassAccuracy", "metrics/eval/loss",
            "lr-SGD/group0"} <= tags, tags
    assert [e.step for e in events.Scalars("loss/train/total")] == list(range(1, 9))
    assert [e.step for e in events.Scalars("metrics/eval/MulticlassAccuracy")] == [4, 8]
    assert all(e.value == 0.5 for e in events.Scalars("metrics/train/aux"))
    hparams = events.PluginTagToContent("hparams")  # add_hparams' summaries, beside the scalars
    assert "_hparams_/session_start_info" in hparams and b"width" in hparams["_hparams_/experiment"]


def test_a_file_logger_writes_text_and_jsonl(tmp_path):
    text, lines = tmp_path / "{run_name}" / "log-{rank}.txt", tmp_path / "log.jsonl"
    with _trainer(tmp_path, [FileLogger(str(text), flush_interval=1), FileLogger(str(lines))],
                  [OwnProcessLogs().in_own_process()]) as trainer:
        trainer.fit()
    written = (tmp_path / "logged" / "log-0.txt").read_text().splitlines()
    assert any(line.startswith("[metric][batch=1]: loss/train/total: ") for line in written)
    assert "[hyperparameter]: lr: 0.1" in written
    assert any(line.startswith("[metric][batch=4]: metrics/eval/loss: ") for line in written)
    records = [json.loads(line) for line in lines.read_text().splitlines()]
    assert records[0]["hparams"] == {"lr": 0.1, "width": 8}
    steps = [r["step"] for r in records if "loss/train/total" in r]
    assert steps == list(range(1, 9))
    assert not any("elsewhere" in r for r in records)  # a callback in its own process logs there


def test_bad_loggers_are_refused_when_the_trainer_is_built(tmp_path):
    with pytest.raises(ConfigError, match="loggers: str is not a logger destination"):
        Trainer(torch.nn.Linear(8, 3), loader(16, 8), "1ep", loss_fn=F.cross_entropy, loggers=["tb"],
                run_dir=tmp_path / "a")
    with pytest.raises(ConfigError, match="loggers run in worker processes and need publish=True"):
        Trainer(torch.nn.Linear(8, 3), loader(16, 8), "1ep", loss_fn=F.cross_entropy,
                loggers=[FileLogger()], publish=False, run_dir=tmp_path / "b")
    with pytest.raises(ValueError, match="FileLogger: filename '{nope}/x.txt' is not a valid format"):
        FileLogger("{nope}/x.txt")
