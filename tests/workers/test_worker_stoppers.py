"""ThresholdStopper and EarlyStopper on real runs: the epoch or batch at which each one
decides (Composer's rules), and the trainer stopping at the batch its ack names.

Metric trajectories are scripted (an eval metric that returns a script, a train loss
that follows one), so each decision point is known in advance. The model takes a few
milliseconds per training step, as real models do, so the worker keeps up with it.
"""

from __future__ import annotations

import pickle
import threading

import pytest
import torch
import torchmetrics
from helpers.data import dataset
from helpers.harness import MemoryLog, Paced, run_with_worker
from torch.nn import functional as F
from torch.utils.data import DataLoader

from offloop.trainer import Trainer
from offloop.workers.callbacks import EarlyStopper, ThresholdStopper

BATCHES = 8  # per epoch: the harness trains on 64 samples in batches of 8


class Scripted(torchmetrics.Metric):
    """An eval metric whose n-th evaluation returns script[n] (the last value after that)."""

    full_state_update = False

    def __init__(self, script):
        super().__init__()
        self.script, self.calls = list(script), 0
        self.add_state("seen", default=torch.tensor(0), dist_reduce_fx="sum")

    def update(self, preds, target):
        self.seen += target.numel()

    def compute(self):
        value = self.script[min(self.calls, len(self.script) - 1)]
        self.calls += 1
        return torch.tensor(value)


def scripted_loss(values):
    """A loss_fn whose value at the n-th training batch is values[n] (eval: cross entropy)."""
    calls = []

    def loss_fn(outputs, targets):
        real = F.cross_entropy(outputs, targets)
        if not torch.is_grad_enabled():
            return real
        calls.append(1)
        return real * 0 + values[min(len(calls), len(values)) - 1]

    return loss_fn


def run(callbacks, tmp_path, script=(0.5,), **kw):
    log = MemoryLog()
    kw.setdefault("model", Paced())
    kw.setdefault("eval_metrics", {"Scripted": Scripted(script)})
    trainer, _ = run_with_worker(callbacks, tmp_path, destinations=[log], **kw)
    return trainer, log


def assert_stopped_by(stopper, trainer, decided_batch: int) -> None:
    """The halt was acked, the trainer stopped at the acked batch, shortly after the decision."""
    ack = stopper.wait(5.0)
    assert ack is not None and ack.ok, (ack, stopper.halt_error)
    step = ack.result["step"]
    assert trainer.timestamp.batch == step
    # a batch_end decision can even reach the trainer before it reads requests after that batch
    assert decided_batch <= step <= decided_batch + BATCHES
    assert trainer.stopped_by["reason"] == stopper.halt_reason


def test_early_stopper_halts_once_patience_epochs_pass_without_improvement(tmp_path):
    script = [0.50, 0.60, 0.60, 0.55, 0.70, 0.70]
    stopper = EarlyStopper("Scripted", "eval", patience=1)
    patient = EarlyStopper("Scripted", "eval", patience=2)
    trainer, log = run([stopper, patient], tmp_path, script, max_duration="6ep")
    # best 0.60 at epoch 2; epoch 3 waited 1 (not > 1); epoch 4 waited 2 > 1: stop
    assert (stopper.halted_at.epoch, stopper.halted_at.batch) == (4, 4 * BATCHES)
    assert stopper.best == pytest.approx(0.60) and stopper.best_occurred.epoch == 2
    assert_stopped_by(stopper, trainer, 4 * BATCHES)
    assert trainer.timestamp.epoch == 4  # stopped inside epoch 5, before its end
    assert patient.halted_at is None  # waited 2, not more than 2
    assert stopper.halt_reason.startswith("EarlyStopper at epoch 4, batch 32: Scripted on eval")
    assert any(t.endswith("asking the trainer to stop") for t in log.texts)
    assert "EarlyStopper: the trainer stopped after batch" in log.texts[-1]


def test_early_stopper_min_delta_and_comparison_direction(tmp_path):
    script = [0.50, 0.52, 0.54, 0.56, 0.58, 0.60]  # rising by 0.02 per epoch
    big_delta = EarlyStopper("Scripted", "eval", min_delta=0.05, patience=1)
    lower_better = EarlyStopper("Scripted", "eval", comparison="lt", patience=1)
    default = EarlyStopper("Scripted", "eval", patience=1)  # 'Scripted': higher is better
    trainer, _ = run([big_delta, lower_better, default], tmp_path, script, max_duration="6ep")
    # +0.02 and +0.04 do not beat 0.50 by more than 0.05: at epoch 3 it waited 2 > 1
    assert big_delta.halted_at.epoch == 3 and big_delta.best == pytest.approx(0.50)
    assert lower_better.halted_at.epoch == 3 and lower_better.best == pytest.approx(0.50)
    assert default.halted_at is None and default.best == pytest.approx(0.54)
    assert_stopped_by(big_delta, trainer, 3 * BATCHES)


def test_early_stopper_patience_in_batches_on_the_train_loss(tmp_path):
    # loss falls by 0.05 per batch to 0.5 at batch 11, then stays there
    losses = [max(0.5, 1.0 - 0.05 * i) for i in range(100)]
    stopper = EarlyStopper("loss", "train", patience="3ba")
    trainer, _ = run([stopper], tmp_path, loss_fn=scripted_loss(losses), max_duration="4ep")
    assert stopper.best_occurred.batch == 11
    assert stopper.halted_at.batch == 15  # 15 - 11 = 4 batches > 3
    assert_stopped_by(stopper, trainer, 15)


def test_threshold_stopper_on_an_eval_metric(tmp_path):
    script = [0.50, 0.65, 0.72, 0.90]
    stopper = ThresholdStopper("Scripted", "eval", 0.7)
    higher = ThresholdStopper("Scripted", "eval", 0.8)
    below = ThresholdStopper("Scripted", "eval", 0.4, comp="lt")
    trainer, _ = run([stopper, higher, below], tmp_path, script, max_duration="5ep")
    assert (stopper.halted_at.epoch, stopper.halted_at.batch) == (3, 3 * BATCHES)
    assert higher.halted_at is None and below.halted_at is None
    assert_stopped_by(stopper, trainer, 3 * BATCHES)


@pytest.mark.parametrize("stop_on_batch, decided_batch", [(True, 7), (False, BATCHES)])
def test_threshold_stopper_on_the_train_loss_at_a_batch_or_at_epoch_end(tmp_path, stop_on_batch,
                                                                        decided_batch):
    losses = [1.0 - 0.05 * i for i in range(100)]  # 0.70 at batch 7, 0.65 at batch 8
    stopper = ThresholdStopper("loss", "train", 0.72, stop_on_batch=stop_on_batch)
    trainer, _ = run([stopper], tmp_path, loss_fn=scripted_loss(losses), max_duration="3ep")
    assert stopper.halted_at.batch == decided_batch
    assert stopper.halted_at.epoch == (0 if stop_on_batch else 1)
    assert_stopped_by(stopper, trainer, decided_batch)


def test_a_decision_at_the_end_of_the_run_sends_no_halt(tmp_path):
    stopper = ThresholdStopper("Scripted", "eval", 0.7)
    trainer, log = run([stopper], tmp_path, [0.5, 0.9], max_duration="2ep")
    assert stopper.halted_at.epoch == 2
    assert stopper.halt_ack is None and "max_duration" in stopper.halt_error
    assert trainer.stopped_by is None and trainer.timestamp.epoch == 2
    assert any("training ends here anyway" in t for t in log.texts)


def test_an_early_stopper_in_its_own_process_halts_the_run(tmp_path):
    """Trainer(callbacks=[...]): the stopper runs in a worker process, and the trainer stops
    at the eval it judged, as Composer's in-process stopper stops it."""
    script = [0.50, 0.60, 0.60, 0.55, 0.70, 0.70]
    with Trainer(Paced(), DataLoader(dataset(), batch_size=8), "6ep", loss_fn=F.cross_entropy,
                 eval_dataloader=DataLoader(dataset(32, seed=2), batch_size=16),
                 eval_metrics={"Scripted": Scripted(script)}, run_dir=tmp_path / "run", seed=3,
                 callbacks=[EarlyStopper("Scripted", "eval", patience=1)]) as trainer:
        trainer.fit()
    assert trainer.stopped_by["reason"].startswith("EarlyStopper at epoch 4, batch 32: ")
    assert trainer.timestamp.batch == trainer.stopped_by["step"]
    assert trainer.timestamp.batch == 4 * BATCHES


def test_stoppers_survive_pickling_before_and_after_a_decision():
    stopper = EarlyStopper("Scripted", "eval", patience="2ba")
    copy = pickle.loads(pickle.dumps(stopper))
    assert (copy.monitor, copy.patience, copy.halted_at) == ("Scripted", stopper.patience, None)
    stopper._sender = threading.Thread()
    assert pickle.loads(pickle.dumps(stopper))._sender is None


def test_options_are_checked_and_default_comparisons_follow_the_metric_name():
    assert EarlyStopper("val_loss", "eval").comp_func(0.1, 0.2)  # lower is better
    assert EarlyStopper("Perplexity", "eval").comp_func(1.0, 2.0)
    assert ThresholdStopper("MulticlassAccuracy", "eval", 0.9).comp_func(0.95, 0.9)
    assert ThresholdStopper("acc", "eval", 0.9, comp=torch.greater).comp_func is torch.greater
    assert EarlyStopper("acc", "eval", patience=3).patience.value == 3
    assert str(EarlyStopper("acc", "eval", patience="100ba").patience) == "100ba"
    with pytest.raises(ValueError, match="epochs or batches"):
        EarlyStopper("acc", "eval", patience="100sp")
    with pytest.raises(ValueError, match="bad duration"):
        EarlyStopper("acc", "eval", patience="soon")
    with pytest.raises(ValueError, match="'gt', 'greater', 'lt', 'less'"):
        ThresholdStopper("acc", "eval", 0.9, comp="bigger")
    with pytest.raises(TypeError, match="not both"):
        EarlyStopper("acc", "eval", comp="gt", comparison="lt")
