"""ClassificationMetricsCallback on real runs: metrics computed in the worker from published
eval outputs equal the ones torchmetrics computes in the trainer, evaluation by evaluation
(so the metrics are reset in between), and a trainer that publishes no outputs is named."""

from __future__ import annotations

import pickle

import pytest
import torch
from helpers.data import dataset
from helpers.harness import MemoryLog, run_with_worker
from torch.utils.data import DataLoader
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score, MulticlassPrecision

from offloop.workers import Callback
from offloop.workers.callbacks import ClassificationMetricsCallback


class EvalRecorder(Callback):
    """The eval metrics the trainer published at each eval_end, by dataloader label."""

    def __init__(self):
        self.values = {}

    def eval_end(self, state, logger):
        label = state.dataloader_label
        self.values.setdefault(label, []).append(dict(state.eval_metrics[label]))


def test_worker_metrics_equal_the_trainers_at_each_eval(tmp_path):
    log = MemoryLog()
    micro = ClassificationMetricsCallback(num_classes=3)
    macro = ClassificationMetricsCallback(num_classes=3, average="macro",
                                          metrics=("accuracy", "precision", "recall", "f1"))
    recorder = EvalRecorder()
    trainer, worker = run_with_worker(
        [micro, macro, recorder], tmp_path, destinations=[log], publish_eval_outputs=True,
        eval_metrics={"MulticlassAccuracy": MulticlassAccuracy(num_classes=3),
                      "MicroAccuracy": MulticlassAccuracy(num_classes=3, average="micro"),
                      "F1": MulticlassF1Score(num_classes=3)})

    assert worker.stats.errors == 0
    published = recorder.values["eval"]
    assert len(published) == len(micro.history["eval"]) == len(macro.history["eval"]) == 3
    # values change between evals, so a metric that was not reset would not match
    assert len({round(p["MulticlassAccuracy"], 6) for p in published}) > 1
    for mine, theirs in zip(macro.history["eval"], published, strict=True):
        assert mine["accuracy"] == pytest.approx(theirs["MulticlassAccuracy"], abs=1e-6)
        assert mine["f1"] == pytest.approx(theirs["F1"], abs=1e-6)
    for mine, theirs in zip(micro.history["eval"], published, strict=True):
        assert mine["accuracy"] == pytest.approx(theirs["MicroAccuracy"], abs=1e-6)
    # the last evaluation saw the final weights: recompute its precision from the model
    x, y = dataset(32, seed=2).tensors
    with torch.no_grad():
        outputs = trainer.model.eval()(x)
    expected = MulticlassPrecision(num_classes=3, average="macro")(outputs, y).item()
    assert macro.history["eval"][-1]["precision"] == pytest.approx(expected, abs=1e-6)
    assert log.values("eval/f1") == [h["f1"] for h in macro.history["eval"]]
    assert len(log.values("eval/recall")) == 6  # both callbacks, three evaluations
    # it still travels to a worker process after a run, without its metric state
    assert pickle.loads(pickle.dumps(macro)).history == macro.history


def test_dataloader_label_picks_one_eval_dataloader(tmp_path):
    only_b = ClassificationMetricsCallback(num_classes=3, dataloader_label="b", average="macro")
    recorder = EvalRecorder()
    run_with_worker(
        [only_b, recorder], tmp_path, max_duration="2ep", publish_eval_outputs=True,
        eval_dataloader={"a": DataLoader(dataset(16, seed=5), batch_size=8),
                         "b": DataLoader(dataset(24, seed=6), batch_size=8)},
        eval_metrics={"MulticlassAccuracy": MulticlassAccuracy(num_classes=3)})

    assert list(only_b.history) == ["b"]
    assert [h["accuracy"] for h in only_b.history["b"]] == pytest.approx(
        [p["MulticlassAccuracy"] for p in recorder.values["b"]], abs=1e-6)
    assert recorder.values["a"] != recorder.values["b"]


def test_without_published_outputs_it_says_what_to_turn_on(tmp_path):
    log = MemoryLog()
    callback = ClassificationMetricsCallback(num_classes=3)
    _, worker = run_with_worker([callback], tmp_path, max_duration="1ep", destinations=[log])
    assert any("publish_eval_outputs=True" in t for t in log.texts)
    assert worker.stats.errors == 1 and worker.disabled == {0}
    assert callback.history == {}


@pytest.mark.parametrize("kwargs", [{"num_classes": 1}, {"num_classes": 3, "task": "ranking"},
                                    {"num_classes": 3, "metrics": ("accuracy", "bleu")},
                                    {"num_classes": 3, "metrics": "accuracy"},
                                    {"num_classes": 3, "average": "samples"},
                                    {"num_classes": 3, "metrics": {"acc": object()}}])
def test_bad_options_fail_early(kwargs):
    with pytest.raises(ValueError, match="ClassificationMetricsCallback"):
        ClassificationMetricsCallback(**kwargs)
