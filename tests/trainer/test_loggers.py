"""`Trainer(loggers=[...])`: Composer's logger classes run in the worker that holds them,
get what Composer's Trainer logs (the loss each step, eval metrics, hyperparameters) and
what callbacks log, and are read back from their real files."""

from __future__ import annotations

import json
import sys

import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from helpers.import_watch import ReportsTorch
from helpers.logging_parts import Breaks, LogsImages, OwnProcessLogs, Stalls
from helpers.tracking_servers import MlflowServer, wandb_history, wandb_records
from helpers.trainers import loader, small_trainer
from helpers.waiting import wait_until
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from offloop import log_metrics
from offloop.loggers import (
    FileLogger,
    MissingExtraError,
    MLFlowLogger,
    TensorboardLogger,
    WandBLogger,
)
from offloop.trainer import ConfigError, Trainer
from offloop.workers.callbacks import LRMonitor


class Logs(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 3)

    def forward(self, x):
        if self.training:
            log_metrics({"aux": 0.5})
        return self.linear(x)


def _trainer(tmp_path, loggers, callbacks=()):
    torch.manual_seed(0)
    return small_trainer(tmp_path, "2ep", model=Logs(), eval_dataloader=loader(16, 8, shuffle=False),
                         eval_metrics=torchmetrics.classification.MulticlassAccuracy(num_classes=3),
                         callbacks=list(callbacks), loggers=loggers, run_name="logged",
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


def test_the_tensorboard_logger_writes_without_torch_in_its_worker(tmp_path):
    # torch's SummaryWriter imports torch: over a second of the worker's start, most of its memory
    log_dir = tmp_path / "tb"
    with _trainer(tmp_path, [TensorboardLogger(log_dir=str(log_dir))], [ReportsTorch()]) as trainer:
        trainer.fit()
    events = EventAccumulator(str(log_dir / "logged"))
    events.Reload()
    assert [e.value for e in events.Scalars("worker/torch_imported")] == [0.0]
    assert [e.step for e in events.Scalars("loss/train/total")] == list(range(1, 9))


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


def test_mlflow_runs_hold_the_loss_eval_metrics_params_and_tags_on_a_real_tracking_server(tmp_path):
    from mlflow import MlflowClient

    with MlflowServer(tmp_path / "mlflow") as server:
        logger = MLFlowLogger(experiment_name="offloop-tests", tracking_uri=server.url, tags={"team": "a"},
                              log_system_metrics=False, rename_metrics={"metrics/train/aux": "aux"},
                              ignore_hyperparameters=["wid*"])
        with _trainer(tmp_path, [logger], [LRMonitor()]) as trainer:
            trainer.fit()
        client = MlflowClient(server.url)
        experiment = client.get_experiment_by_name("offloop-tests")
        [run] = client.search_runs([experiment.experiment_id])
        assert run.info.run_name == "logged" and run.info.status == "FINISHED"
        assert run.data.tags["team"] == "a" and run.data.tags["run_name"] == "logged"
        assert run.data.params == {"lr": "0.1"}  # width is ignored by pattern
        history = client.get_metric_history(run.info.run_id, "loss/train/total")
        assert sorted(m.step for m in history) == list(range(1, 9))
        accuracy = client.get_metric_history(run.info.run_id, "metrics/eval/MulticlassAccuracy")
        assert sorted(m.step for m in accuracy) == [4, 8]
        aux = client.get_metric_history(run.info.run_id, "aux")  # renamed; unchanged, so sent once
        assert [(m.step, m.value) for m in aux] == [(1, 0.5)]
        assert "lr-SGD/group0" in run.data.metrics


def test_a_wandb_offline_run_holds_the_loss_eval_metrics_images_and_config(tmp_path):
    wandb_dir = tmp_path / "wandb-runs"
    wandb_dir.mkdir()
    logger = WandBLogger(project="offloop-tests", tags=["ci"], init_kwargs={"mode": "offline", "dir": str(wandb_dir)})
    with _trainer(tmp_path, [logger], [LogsImages()]) as trainer:
        trainer.fit()
    [run_file] = list(wandb_dir.glob("wandb/offline-run-*/run-*.wandb"))
    records = wandb_records(run_file)
    [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.display_name == "logged" and run.project == "offloop-tests" and list(run.tags) == ["ci"]
    config = {}
    for record in records:
        if record.WhichOneof("record_type") in ("run", "config"):
            items = record.run.config.update if record.WhichOneof("record_type") == "run" else record.config.update
            config.update({item.key: json.loads(item.value_json) for item in items})
    assert config["lr"] == 0.1 and config["width"] == 8
    history = wandb_history(records)
    losses = [row["_step"] for row in history if "loss/train/total" in row]
    assert losses == list(range(1, 9))
    assert [row["_step"] for row in history if "metrics/eval/MulticlassAccuracy" in row] == [4, 8]
    [images] = [row for row in history if "samples/_type" in row]  # log_images' media, at fit_end
    assert (images["_step"], images["samples/count"], images["samples/width"]) == (8, 2, 8)
    assert all((run_file.parent / "files" / name).is_file() for name in images["samples/filenames"])
    [exit_record] = [r.exit for r in records if r.WhichOneof("record_type") == "exit"]
    assert exit_record.exit_code == 0


def test_a_destination_that_raises_is_left_out_and_the_others_get_everything(tmp_path, capfd):
    lines = tmp_path / "log.jsonl"
    with _trainer(tmp_path, [Breaks(), FileLogger(str(lines))]) as trainer:
        trainer.fit()
    steps = [r["step"] for r in map(json.loads, lines.read_text().splitlines()) if "loss/train/total" in r]
    assert steps == list(range(1, 9))
    err = capfd.readouterr().err
    assert err.count("offloop logger: Breaks.log_metrics raised OSError('disk full')") == 1


def test_a_stalled_logger_holds_up_no_decision_of_its_worker_and_gets_everything_later(tmp_path):
    gate, out, folder = tmp_path / "gate", tmp_path / "delivered.jsonl", tmp_path / "checkpoints"
    torch.manual_seed(0)
    # the CheckpointSaver that save_folder starts shares the loggers' worker, and the loop
    # waits for its decision at each epoch's checkpoint event
    with Trainer(Logs(), loader(32, 8, shuffle=False), "2ep", loss_fn=F.cross_entropy,
                 eval_dataloader=loader(16, 8, shuffle=False), loggers=[Stalls(gate, out)],
                 save_folder=str(folder), save_interval="1ep", decision_timeout=20,
                 run_dir=tmp_path / "run", run_name="stalled", seed=1) as trainer:
        trainer.fit()
        assert [worker.name for worker in trainer.workers.workers] == ["loggers"]
        assert sorted(path.name for path in folder.glob("ep*.pt")) == ["ep1-ba4-rank0.pt", "ep2-ba8-rank0.pt"]
        assert not out.exists(), "the loop waited for a logger"
        gate.touch()
    records = [json.loads(line) for line in out.read_text().splitlines()]  # close() let it finish
    assert [r["step"] for r in records if "loss/train/total" in r["names"]] == list(range(1, 9))
    assert [r["step"] for r in records if "metrics/eval/loss" in r["names"]] == [4, 8]


def test_close_waits_for_a_stalled_loggers_calls_and_says_so_when_it_gives_up(tmp_path, caplog):
    gate, out = tmp_path / "gate", tmp_path / "delivered.jsonl"  # the gate never opens
    torch.manual_seed(0)
    with Trainer(Logs(), loader(32, 8, shuffle=False), "1ep", loss_fn=F.cross_entropy,
                 loggers=[Stalls(gate, out)], worker_shutdown_timeout=3, run_dir=tmp_path / "run",
                 seed=1) as trainer:
        trainer.fit()
        [worker] = trainer.workers.workers  # on a busy machine its callbacks reach fit_end late
        wait_until(lambda: worker.fits_seen == 1, 60, "the worker's callbacks to handle fit_end")
    assert "callback worker loggers is past fit_end, its loggers still making calls (" in caplog.text
    assert "callback worker loggers had not logged everything up to fit_end after 3s" in caplog.text
    assert not out.exists()
    # what it still held is counted as well as said: the 4 batches' metrics but the one
    # whose call never returned, at least
    lost = trainer.workers.logs_lost
    assert lost >= 3 and f"({lost} logger calls queued at its last report are lost with it)" in caplog.text


def test_tensorboard_gets_images_from_log_images(tmp_path):
    log_dir = tmp_path / "tb"
    with _trainer(tmp_path, [TensorboardLogger(log_dir=str(log_dir))], [LogsImages()]) as trainer:
        trainer.fit()
    events = EventAccumulator(str(log_dir / "logged"), size_guidance={"images": 0})
    events.Reload()
    assert set(events.Tags()["images"]) == {"samples/0", "samples/1"}
    [image] = events.Images("samples/0")
    assert (image.step, image.width, image.height) == (8, 8, 8)


@pytest.mark.parametrize("module, build", [("mlflow", lambda: MLFlowLogger()), ("wandb", lambda: WandBLogger()),
                                           ("tensorboard", lambda: TensorboardLogger())])
def test_a_missing_extra_is_named_when_the_logger_is_built(monkeypatch, module, build):
    monkeypatch.setitem(sys.modules, module, None)  # how Python marks a module as not importable
    with pytest.raises(MissingExtraError, match=rf"needs {module}, which is not installed: "
                                                rf"pip install 'offloop\[{module}\]'"):
        build()
