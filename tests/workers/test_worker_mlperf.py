"""MLPerfCallback on real runs: the result file holds MLLOG lines in MLPerf's order with the
values the trainer published; the run ends `aborted` short of the target, `success` at it,
and with exit_at_target the trainer halts at the batch the ack names."""

from __future__ import annotations

import json
import pickle

import pytest
import torchmetrics
from helpers.harness import MemoryLog, Paced, run_with_worker

from offloop.workers import Callback
from offloop.workers.callbacks import MLPerfCallback

HEADER = ["init_start", "submission_benchmark", "submission_division", "submission_org",
          "submission_platform", "submission_status", "seed", "global_batch_size",
          "gradient_accumulation_steps", "train_samples", "eval_samples", "init_stop", "run_start"]
EPOCH = ["epoch_start", "block_start", "epoch_stop", "eval_start", "eval_stop", "eval_accuracy",
         "block_stop"]
FIELDS = ["namespace", "time_ms", "event_type", "key", "value", "metadata"]


class EvalRecorder(Callback):
    """What the trainer published as the eval metric at each eval_end."""

    def __init__(self):
        self.values = []

    def eval_end(self, state, logger):
        self.values.append(state.eval_metrics["eval"]["MulticlassAccuracy"])


def read_mllog(path) -> list[dict]:
    lines = path.read_text().splitlines()
    assert lines and all(line.startswith(":::MLLOG ") for line in lines), lines[:3]
    events = [json.loads(line[len(":::MLLOG "):]) for line in lines]
    for event in events:
        assert list(event) == FIELDS
    times = [e["time_ms"] for e in events]
    assert times == sorted(times), "time_ms goes backwards"
    return events


def accuracy():
    return {"MulticlassAccuracy": torchmetrics.classification.MulticlassAccuracy(num_classes=3)}


def test_result_file_short_of_target_ends_aborted(tmp_path):
    recorder = EvalRecorder()
    mlperf = MLPerfCallback(tmp_path / "submission", index=0, target=1.01, system_name="1xtest")
    run_with_worker([recorder, mlperf], tmp_path, eval_metrics=accuracy())

    result = tmp_path / "submission" / "results" / "1xtest" / "resnet" / "result_0.txt"
    events = read_mllog(result)
    keys = [e["key"] for e in events]
    # the run's sizes, from the config the trainer publishes, before run_start
    assert keys == HEADER + EPOCH + EPOCH + EPOCH + ["run_stop"]
    sizes = {e["key"]: e["value"] for e in events if e["key"] in ("global_batch_size", "train_samples", "eval_samples")}
    assert sizes == {"global_batch_size": 8, "train_samples": 64, "eval_samples": 32}
    by_key = {e["key"]: e for e in events}
    assert by_key["submission_benchmark"]["value"] == "resnet"
    assert by_key["submission_platform"]["value"] == "1xtest"
    assert (by_key["seed"]["value"], by_key["global_batch_size"]["value"],
            by_key["train_samples"]["value"], by_key["gradient_accumulation_steps"]["value"]) == (3, 8, 64, 1)
    assert by_key["run_stop"]["metadata"] == {"status": "aborted"}
    assert by_key["run_stop"]["event_type"] == "INTERVAL_END"
    accuracies = [e for e in events if e["key"] == "eval_accuracy"]
    assert [e["metadata"]["epoch_num"] for e in accuracies] == [1, 2, 3]
    assert [e["metadata"]["epoch_num"] for e in events if e["key"] == "epoch_start"] == [1, 2, 3]
    assert [e["value"] for e in accuracies] == pytest.approx(recorder.values, abs=1e-7)
    assert len(recorder.values) == 3 and not mlperf.success
    systems = json.loads((tmp_path / "submission" / "systems" / "1xtest.json").read_text())
    assert systems["system_name"] == "1xtest" and systems["division"] == "open"
    # the trainer publishes device_name "cpu" on the CPU: no accelerator is claimed
    assert systems["accelerators_per_node"] == "0" and systems["accelerator_model_name"] == ""


def test_exit_at_target_logs_success_and_halts_the_run(tmp_path):
    log = MemoryLog()
    mlperf = MLPerfCallback(tmp_path / "submission", index=1, target=0.0, exit_at_target=True)
    trainer, _ = run_with_worker([mlperf], tmp_path, max_duration="4ep", destinations=[log],
                                 model=Paced(), eval_metrics=accuracy())

    assert mlperf.success and mlperf.system_name.endswith("_offloop")
    result = tmp_path / "submission" / "results" / mlperf.system_name / "resnet" / "result_1.txt"
    events = read_mllog(result)
    keys = [e["key"] for e in events]
    # success at the first eval; nothing is logged after run_stop
    assert keys[-4:] == ["eval_stop", "eval_accuracy", "block_stop", "run_stop"]
    assert keys.count("eval_accuracy") == 1 and keys.count("run_stop") == 1
    assert events[-1]["metadata"] == {"status": "success"}
    # the trainer stopped in epoch 2, at the step its ack names
    assert mlperf.halt_ack is not None and mlperf.halt_ack.ok, mlperf.halt_error
    assert trainer.stopped_by is not None and "MLPerfCallback" in trainer.stopped_by["reason"]
    assert 8 < trainer.timestamp.batch < 32
    assert mlperf.halt_ack.result["step"] == trainer.stopped_by["step"] == trainer.timestamp.batch
    assert any("stopped after batch" in t for t in log.texts)
    # it still travels to a worker process after a run (no open file, no thread)
    assert pickle.loads(pickle.dumps(mlperf)).success


def test_existing_result_file_and_bad_options_fail_early(tmp_path):
    result = tmp_path / "results" / "sys" / "resnet" / "result_0.txt"
    result.parent.mkdir(parents=True)
    result.write_text("")
    with pytest.raises(FileExistsError, match="result_0.txt already exists"):
        MLPerfCallback(tmp_path, index=0, system_name="sys")
    for bad in ({"benchmark": "gpt"}, {"division": "closed"}, {"status": "lab"}, {"index": -1},
                {"target": "high"}):
        with pytest.raises(ValueError, match="MLPerfCallback"):
            MLPerfCallback(tmp_path, **{"index": 0, **bad})
