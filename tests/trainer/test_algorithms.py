"""`Trainer(algorithms=[...])`: Composer's Algorithm protocol in the training process.
Each built-in is checked against a hand-written loop doing the same by hand, step for
step, and against the run without it (so the test can fail)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from helpers.trainers import loader, mlp, small_trainer

from offloop import Event, log_metrics
from offloop.algorithms import EMA, Algorithm, GradientClipping
from offloop.loggers import FileLogger
from offloop.trainer import ConfigError

STEPS = 8  # 64 samples in batches of 8, one epoch


def _trainer(tmp_path, algorithms, name="run", **kw):
    """On the CPU, where the hand-written loop it is compared with runs, GPU or not."""
    model = _no_dropout(mlp(seed=3))  # the hand-written loop draws no random numbers either
    return small_trainer(tmp_path, kw.pop("max_duration", "1ep"), model=model, name=name, samples=64,
                         optimizers=kw.pop("optimizer", None), algorithms=algorithms, seed=1,
                         publish=kw.pop("publish", False), device="cpu", **kw)


def _no_dropout(model: torch.nn.Module) -> torch.nn.Module:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def _hand_loop(clip=None, steps=STEPS, ema_smoothing=None):
    """SGD(lr=0.1) on the same data; `clip(model)` between backward and step; with
    `ema_smoothing`, the average of the weights after each step, begun after the first."""
    model = _no_dropout(mlp(seed=3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    average = None
    for step, (x, y) in enumerate(loader(64, 8, shuffle=False)):
        if step == steps:
            break
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if clip is not None:
            clip(model)
        opt.step()
        if ema_smoothing is not None and average is None:  # as Composer's: from the weights at the start
            average = copy.deepcopy(model)
        elif average is not None:
            with torch.no_grad():
                for a, p in zip(average.parameters(), model.parameters(), strict=True):
                    a.mul_(ema_smoothing).add_(p, alpha=1 - ema_smoothing)
    return model, average


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.allclose(p, q, atol=1e-6) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def _agc(model: torch.nn.Module, threshold: float) -> None:
    """Adaptive clipping written out here (Brock et al. 2021, unit-wise), independently of ours."""
    for p in model.parameters():
        dims = tuple(range(1, p.ndim)) if p.ndim > 1 else None
        w = p.detach().norm(dim=dims, keepdim=p.ndim > 1) if dims else p.detach().norm()
        g = p.grad.norm(dim=dims, keepdim=p.ndim > 1) if dims else p.grad.norm()
        p.grad.mul_(torch.clamp(torch.nan_to_num(w * threshold / g, nan=1.0), max=1.0))


@pytest.mark.parametrize("kind, threshold, clip", [
    ("norm", 0.05, lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)),
    ("value", 0.002, lambda m: torch.nn.utils.clip_grad_value_(m.parameters(), 0.002)),
    ("adaptive", 0.01, lambda m: _agc(m, 0.01)),
])
def test_gradient_clipping_steps_as_the_hand_written_loop_that_clips(tmp_path, kind, threshold, clip):
    trainer = _trainer(tmp_path, [GradientClipping(kind, threshold)], optimizer=None)
    trainer.fit()
    trainer.close()
    clipped, _ = _hand_loop(clip)
    unclipped, _ = _hand_loop()
    assert _same(trainer.model, clipped)
    assert not _same(trainer.model, unclipped)  # the clipping changed the steps
    assert trainer.algorithm_seconds["GradientClipping"] > 0


def test_ema_evaluates_with_the_average_trains_the_training_weights_and_resumes_exactly(tmp_path):
    evaluation = loader(32, 8, shuffle=False, dataset=None)
    with _trainer(tmp_path, [EMA(half_life=None, smoothing=0.8)], name="whole", eval_dataloader=evaluation) as trainer:
        trainer.fit()
        evaluated = trainer.eval()["eval"]["loss"]
        trained = copy.deepcopy(trainer.model)
    weights, average = _hand_loop(ema_smoothing=0.8)
    assert _same(trained, weights)  # training stepped the training weights, not the average
    x, y = next(iter(loader(32, 32, shuffle=False)))
    with torch.no_grad():
        expected = F.cross_entropy(average(x), y).item()
        unaveraged = F.cross_entropy(weights(x), y).item()
    assert evaluated == pytest.approx(expected, rel=1e-5)
    assert evaluated != pytest.approx(unaveraged, rel=1e-3)

    # a checkpoint at batch 4, resumed: the same average at the end
    with _trainer(tmp_path, [EMA(half_life=None, smoothing=0.8)], name="first", max_duration="4ba") as first:
        first.fit()
        path = first.save_checkpoint()
    with _trainer(tmp_path, [EMA(half_life=None, smoothing=0.8)], name="second", load_path=path,
                  eval_dataloader=evaluation) as second:
        second.fit()
        assert second.eval()["eval"]["loss"] == pytest.approx(expected, rel=1e-5)


class Records(Algorithm):
    """Composer's protocol as a user writes it: matches every event, logs a metric."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def match(self, event, state) -> bool:
        return True

    def apply(self, event, state, logger) -> None:
        self.events.append(event)
        if event is Event.BATCH_END:
            logger.log_metrics({"algo/batch": float(state.timestamp.batch)})


def test_an_algorithm_sees_every_event_in_composers_order_and_its_metrics_reach_the_loggers(tmp_path):
    records = Records()
    lines = tmp_path / "log.jsonl"
    with _trainer(tmp_path, [records], publish=True, max_duration="2ba", loggers=[FileLogger(str(lines))]) as trainer:
        trainer.fit()
    step = [Event.BATCH_START, Event.BEFORE_TRAIN_BATCH, Event.BEFORE_FORWARD, Event.AFTER_FORWARD,
            Event.BEFORE_LOSS, Event.AFTER_LOSS, Event.BEFORE_BACKWARD, Event.AFTER_BACKWARD,
            Event.AFTER_TRAIN_BATCH, Event.BATCH_END, Event.BATCH_CHECKPOINT, Event.BEFORE_DATALOADER]
    assert records.events[:3] == [Event.INIT, Event.BEFORE_LOAD, Event.AFTER_LOAD]
    fit = records.events[3:]
    assert fit[:5] == [Event.FIT_START, Event.ITERATION_START, Event.EPOCH_START, Event.BEFORE_DATALOADER,
                       Event.AFTER_DATALOADER]
    assert fit[5:5 + len(step)] == step
    assert fit[-1] is Event.FIT_END
    logged = [json.loads(line) for line in lines.read_text().splitlines()]
    assert [r["metrics/train/algo/batch"] for r in logged if "metrics/train/algo/batch" in r] == [1.0, 2.0]


def test_log_metrics_from_an_algorithm_is_the_training_codes_log_metrics(tmp_path):
    with _trainer(tmp_path, []) as trainer:
        log_metrics({"x": 1.0})  # the same path: both land with the step's snapshot
        assert trainer.readings.user_metrics.values == {"x": 1.0}


def test_bad_algorithms_are_refused_when_the_trainer_is_built(tmp_path):
    with pytest.raises(ConfigError, match="algorithms: str is not an algorithm: it needs match"):
        _trainer(tmp_path, ["clip"])
    with pytest.raises(ValueError, match="clipping_type must be 'norm', 'value' or 'adaptive'"):
        GradientClipping("l2", 1.0)
    with pytest.raises(ValueError, match="clipping_threshold must be a number > 0"):
        GradientClipping("norm", 0)
    with pytest.raises(ValueError, match="give half_life or smoothing, not both"):
        EMA(half_life="10ba", smoothing=0.9)
    with pytest.raises(ValueError, match="half_life and update_interval must be in the same unit"):
        EMA(half_life="10ba", update_interval="1ep")
    with pytest.raises(ValueError, match="ema_start: bad duration string 'soon'"):
        EMA(ema_start="soon")


def test_a_checkpoint_with_other_algorithms_is_refused_on_load(tmp_path):
    with _trainer(tmp_path, [EMA(half_life=None, smoothing=0.5), GradientClipping("norm", 1.0)], name="a",
                  max_duration="2ba") as trainer:
        trainer.fit()
        path = trainer.save_checkpoint()
    with pytest.raises(Exception, match="holds the state of 2 algorithms, this trainer has 1"):
        _trainer(tmp_path, [EMA(half_life=None, smoothing=0.5)], name="b", load_path=path)
