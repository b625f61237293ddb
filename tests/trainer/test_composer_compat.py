"""Code written for Composer runs with only the import line changed: callbacks that read
the timestamp as Composer's Time, and algorithms that do."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from helpers.trainers import loader, mlp
from torchmetrics.classification import MulticlassAccuracy

from offloop import Callback, ComposerModel, Event, Trainer
from offloop.algorithms import Algorithm
from offloop.models import ComposerClassifier
from offloop.trainer import ConfigError, TrainerError


class ComposerStyle(Callback):
    """As written for Composer: `.value`, comparisons with time strings, elapsed duration."""

    def __init__(self, path: str) -> None:
        self.path = path

    def epoch_end(self, state, logger) -> None:
        with open(self.path, "a") as out:
            out.write(json.dumps({"epoch": state.timestamp.epoch.value, "batch": state.timestamp.batch.value,
                                  "past_1ep": bool(state.timestamp.epoch >= "1ep"),
                                  "elapsed": state.get_elapsed_duration()}) + "\n")


class CountsEpochs(Algorithm):
    def __init__(self) -> None:
        self.seen = []

    def match(self, event, state) -> bool:
        return event == Event.EPOCH_END

    def apply(self, event, state, logger) -> None:
        self.seen.append((state.timestamp.epoch.value, state.timestamp.epoch.unit.value,
                          state.get_elapsed_duration()))


def test_a_callback_and_an_algorithm_written_for_composers_time_run_unchanged(tmp_path):
    path = tmp_path / "epochs.jsonl"
    algorithm = CountsEpochs()
    with Trainer(mlp(), loader(32, 8), "2ep", loss_fn=F.cross_entropy, callbacks=[ComposerStyle(str(path))],
                 algorithms=[algorithm], run_dir=tmp_path / "run") as trainer:
        trainer.fit()
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"epoch": 1, "batch": 4, "past_1ep": True, "elapsed": 0.5},
        {"epoch": 2, "batch": 8, "past_1ep": True, "elapsed": 1.0}]
    assert algorithm.seen == [(1, "ep", 0.5), (2, "ep", 1.0)]


class Classifier(ComposerModel):
    """Composer's getting-started model, with an MLP for the ResNet, and its metrics."""

    def __init__(self) -> None:
        super().__init__()
        self.model = mlp(seed=5)
        self.val_accuracy = MulticlassAccuracy(num_classes=3, average="micro")

    def forward(self, batch):
        inputs, _ = batch
        return self.model(inputs)

    def loss(self, outputs, batch):
        _, targets = batch
        return F.cross_entropy(outputs, targets)

    def get_metrics(self, is_train=False):
        return {"MulticlassAccuracy": self.val_accuracy}

    def update_metric(self, batch, outputs, metric):
        _, targets = batch
        metric.update(outputs.argmax(dim=1), targets)  # its own way: the trainer calls it


def test_a_composer_model_is_evaluated_with_its_own_metrics_and_update_metric(tmp_path):
    model = Classifier()
    evaluation = loader(32, 8, shuffle=False)
    with Trainer(model, loader(32, 8), "1ep", eval_dataloader=evaluation, run_dir=tmp_path / "run",
                 publish=False) as trainer:
        trainer.fit()
        results = trainer.eval()["eval"]
    x, y = next(iter(loader(32, 32, shuffle=False)))
    with torch.no_grad():
        expected = (model.model.cpu().eval()(x).argmax(dim=1) == y).float().mean().item()
    assert results["MulticlassAccuracy"] == pytest.approx(expected)
    assert "loss" in results


def test_composer_classifier_trains_and_evaluates_with_accuracy(tmp_path):
    model = ComposerClassifier(mlp(seed=2), num_classes=3)
    with Trainer(model, loader(32, 8), "1ep", eval_dataloader=loader(32, 8), run_dir=tmp_path / "run",
                 publish=False) as trainer:
        trainer.fit()
        assert set(trainer.eval()["eval"]) == {"MulticlassAccuracy", "loss"}
    with pytest.raises(ValueError, match="give num_classes"):
        ComposerClassifier(mlp())


class NoTargets(torch.nn.Module):
    """Composer's protocol on a plain module: metrics, but no update_metric or get_targets."""

    def __init__(self) -> None:
        super().__init__()
        self.model = mlp()

    def forward(self, batch):
        return self.model(batch["x"])

    def loss(self, outputs, batch):
        return F.cross_entropy(outputs, batch["y"])

    def get_metrics(self, is_train=False):
        return {"acc": MulticlassAccuracy(num_classes=3)}


class NoUpdate(NoTargets, ComposerModel):
    pass


@pytest.mark.parametrize("model, error, message", [
    (NoTargets, TrainerError, "NoTargets has no update_metric"),
    (NoUpdate, NotImplementedError, r"NoUpdate.get_metrics\(\) returns metrics: write update_metric"),
])
def test_a_composer_model_whose_metrics_cannot_find_targets_is_told_so(tmp_path, model, error, message):
    batches = [{"x": x, "y": y} for x, y in loader(16, 8)]
    with Trainer(model(), batches, "1ep", eval_dataloader=batches, run_dir=tmp_path / "run",
                 publish=False) as trainer, pytest.raises(error, match=message):
        trainer.fit()


class CountsForwards(Algorithm):
    def __init__(self) -> None:
        self.forwards, self.sizes = 0, []

    def match(self, event, state) -> bool:
        return event == Event.BEFORE_FORWARD

    def apply(self, event, state, logger) -> None:
        self.forwards += 1


def _no_dropout_mlp():
    model = mlp(seed=4)
    model[2].p = 0.0
    return model


def test_device_train_microbatch_size_splits_each_batch_by_samples_and_steps_as_the_whole_batch(tmp_path):
    counts = CountsForwards()
    split = Trainer(_no_dropout_mlp(), loader(32, 8, shuffle=False), "1ep", loss_fn=F.cross_entropy,
                    device_train_microbatch_size=3, algorithms=[counts], run_dir=tmp_path / "a", publish=False)
    split.fit()
    whole = Trainer(_no_dropout_mlp(), loader(32, 8, shuffle=False), "1ep", loss_fn=F.cross_entropy,
                    run_dir=tmp_path / "b", publish=False)
    whole.fit()
    assert counts.forwards == 4 * 3  # 8 samples: microbatches of 3, 3 and 2
    for a, b in zip(split.model.parameters(), whole.model.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_bad_microbatch_sizes_are_refused(tmp_path):
    for kw, message in (({"device_train_microbatch_size": "auto"}, "'auto' is not supported"),
                        ({"device_train_microbatch_size": 0}, "must be an int >= 1"),
                        ({"device_train_microbatch_size": 4, "grad_accum": 2}, "not both")):
        with pytest.raises(ConfigError, match=message):
            Trainer(mlp(), loader(32, 8), "1ep", loss_fn=F.cross_entropy, run_dir=tmp_path / "c", publish=False, **kw)
