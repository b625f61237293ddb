"""pytorch-accelerated's callbacks on real events: a real Trainer trains while a real Worker
runs them over real sockets; halts and checkpoints go over the real control channel."""

from __future__ import annotations

import filecmp
import io
import json
import pickle

import pytest
import torch
import torchmetrics
from helpers.harness import MemoryLog, run_with_worker
from torch.utils.data import DataLoader

from offloop.trainer import Trainer
from offloop.trainer.checkpoint import load_checkpoint
from offloop.workers import State
from offloop.workers.callbacks import (
    EarlyStoppingCallback,
    LogMetricsCallback,
    MoveModulesToDeviceCallback,
    PrintProgressCallback,
    ProgressBarCallback,
    SaveBestModelCallback,
    TerminateOnNaNCallback,
    TrainerCallback,
)
from offloop.workers.callbacks.accelerated import (
    HOOKS,
    RUN_HISTORY_TOPICS,
    OutOfProcessError,
    StopTrainingError,
    TrainerView,
)

BATCHES = 8  # the harness trains on 64 samples in batches of 8; it evaluates 32 in batches of 16
EVAL_BATCHES = 2
CONTROL_TIMEOUT = 10.0  # a request the trainer never answers fails the test in 10 s, not 60


def bounded(callback):
    callback.control_timeout = CONTROL_TIMEOUT
    return callback


class ScriptedScore(torchmetrics.Metric):
    """An eval metric that returns the next value of a script at each evaluation."""

    full_state_update = False

    def __init__(self, script):
        super().__init__()
        self.script = list(script)
        self.evaluations = 0

    def update(self, preds, target):
        pass

    def compute(self):
        value = self.script[min(self.evaluations, len(self.script) - 1)]
        self.evaluations += 1
        return torch.tensor(value, dtype=torch.float64)


class NanLossFrom:
    """cross_entropy, made NaN from the `start`-th call (1-based) in training or in evaluation."""

    def __init__(self, start: int, in_training: bool = True):
        self.start, self.in_training, self.calls = start, in_training, 0

    def __call__(self, outputs, targets):
        loss = torch.nn.functional.cross_entropy(outputs, targets)
        if torch.is_grad_enabled() == self.in_training:
            self.calls += 1
            if self.calls >= self.start:
                return loss * float("nan")
        return loss


def assert_halted_at_ack(trainer, ack, decided_at: int, max_batches: int):
    """The trainer stopped at the batch the ack names, after the decision, before the end."""
    assert ack is not None and ack.ok, ack
    step = ack.result["step"]
    assert decided_at <= step < max_batches
    assert trainer.timestamp.batch == step
    assert trainer.stopped_by["step"] == step


# ------------------------------------------------------------------------ the base class


class HookRecorder(TrainerCallback):
    """Records every hook with what pytorch-accelerated callbacks read at it."""

    def __init__(self):
        self.calls = []
        self.step_losses = []
        self.train_loss_epoch = []
        self.eval_loss_epoch = []
        self.published_eval_loss = []

    def on_init_end(self, trainer, **kwargs):
        self.calls.append("on_init_end")

    def on_training_run_start(self, trainer, **kwargs):
        self.calls.append("on_training_run_start")

    def on_train_epoch_start(self, trainer, **kwargs):
        self.calls.append(("on_train_epoch_start", trainer.run_history.current_epoch))

    def on_train_step_start(self, trainer, **kwargs):
        self.calls.append("on_train_step_start")

    def on_train_step_end(self, trainer, batch, batch_output, **kwargs):
        self.calls.append(("on_train_step_end", kwargs["step"]))
        self.step_losses.append(batch_output["loss"])

    def on_train_epoch_end(self, trainer, **kwargs):
        self.calls.append(("on_train_epoch_end", trainer.run_history.current_epoch))
        self.train_loss_epoch.append(trainer.run_history.get_latest_metric("train_loss_epoch"))

    def on_eval_epoch_start(self, trainer, **kwargs):
        self.calls.append("on_eval_epoch_start")

    def on_eval_step_start(self, trainer, **kwargs):
        self.calls.append("on_eval_step_start")

    def on_eval_step_end(self, trainer, batch, batch_output, **kwargs):
        self.calls.append("on_eval_step_end")

    def on_eval_epoch_end(self, trainer, **kwargs):
        self.calls.append(("on_eval_epoch_end", trainer.run_history.current_epoch))
        self.eval_loss_epoch.append(trainer.run_history.get_latest_metric("eval_loss_epoch"))
        self.published_eval_loss.append(trainer.state.eval_metrics["eval"]["loss"])

    def on_training_run_epoch_end(self, trainer, **kwargs):
        self.calls.append("on_training_run_epoch_end")

    def on_training_run_end(self, trainer, **kwargs):
        self.calls.append("on_training_run_end")


def expected_calls(epochs: int) -> list:
    calls: list = ["on_training_run_start"]
    for epoch in range(1, epochs + 1):
        calls.append(("on_train_epoch_start", epoch))
        for step in range(BATCHES):
            calls += ["on_train_step_start", ("on_train_step_end", step)]
        calls.append(("on_train_epoch_end", epoch))
        calls.append("on_eval_epoch_start")
        calls += ["on_eval_step_start", "on_eval_step_end"] * EVAL_BATCHES
        calls += [("on_eval_epoch_end", epoch), "on_training_run_epoch_end"]
    return calls + ["on_training_run_end"]


def test_hooks_fire_in_pytorch_accelerated_order_with_its_run_history(tmp_path):
    recorder = HookRecorder()
    run_with_worker([recorder], tmp_path, max_duration="2ep")
    # the worker joins after the trainer's init, so on_init_end is seen only by workers the
    # trainer starts itself (next test)
    assert recorder.calls == expected_calls(2)
    per_epoch = [recorder.step_losses[:BATCHES], recorder.step_losses[BATCHES:]]
    assert recorder.train_loss_epoch == pytest.approx([sum(e) / BATCHES for e in per_epoch])
    assert recorder.eval_loss_epoch == pytest.approx(recorder.published_eval_loss)
    assert recorder.eval_loss_epoch[1] != recorder.eval_loss_epoch[0]


class SpawnedRecorder(TrainerCallback):
    """Hook names, written to a file at the end of the run (it runs in a worker process)."""

    def __init__(self, path):
        self.path, self.calls = path, []

    def on_init_end(self, trainer, **kwargs):
        self.calls.append("on_init_end")

    def on_training_run_start(self, trainer, **kwargs):
        self.calls.append("on_training_run_start")

    def on_train_epoch_end(self, trainer, **kwargs):
        self.calls.append("on_train_epoch_end")

    def on_eval_epoch_end(self, trainer, **kwargs):
        self.calls.append("on_eval_epoch_end")

    def on_training_run_end(self, trainer, **kwargs):
        self.calls.append("on_training_run_end")
        with open(self.path, "w") as out:
            json.dump(self.calls, out)


def test_a_worker_the_trainer_starts_sees_on_init_end_first(tmp_path):
    from helpers.data import dataset
    from helpers.harness import classifier

    record = tmp_path / "calls.json"
    trainer = Trainer(classifier(), DataLoader(dataset(), batch_size=8), "2ep",
                      loss_fn=torch.nn.functional.cross_entropy,
                      eval_dataloader=DataLoader(dataset(32, seed=2), batch_size=16),
                      callbacks=[SpawnedRecorder(str(record))], run_dir=tmp_path / "run", seed=3,
                      worker_shutdown_timeout=30)
    with trainer:
        trainer.fit()
    assert json.loads(record.read_text()) == [
        "on_init_end", "on_training_run_start",
        "on_train_epoch_end", "on_eval_epoch_end", "on_train_epoch_end", "on_eval_epoch_end",
        "on_training_run_end",
    ]


class StopAtSecondEpoch(TrainerCallback):
    def __init__(self):
        self.steps_seen, self.stopped_at, self.stop_errors, self.run_ends = [], None, [], 0

    def on_train_step_end(self, trainer, batch, batch_output, **kwargs):
        self.steps_seen.append(trainer.state.timestamp.batch)

    def on_train_epoch_end(self, trainer, **kwargs):
        if trainer.run_history.current_epoch == 2:
            self.stopped_at = (trainer.run_history.current_epoch, trainer.state.timestamp.batch)
            raise StopTrainingError("enough")

    def on_stop_training_error(self, trainer, **kwargs):
        self.stop_errors.append((type(trainer), trainer.run_history.current_epoch))

    def on_training_run_end(self, trainer, **kwargs):
        self.run_ends += 1


class StopObserver(TrainerCallback):
    def __init__(self):
        self.calls = []

    def on_stop_training_error(self, trainer, **kwargs):
        self.calls.append(("on_stop_training_error", kwargs.get("reason")))

    def on_training_run_end(self, trainer, **kwargs):
        self.calls.append(("on_training_run_end", None))


def test_stop_training_error_from_a_hook_halts_the_run_and_calls_on_stop_training_error(tmp_path):
    stopper, observer = bounded(StopAtSecondEpoch()), StopObserver()
    trainer, _ = run_with_worker([stopper, observer], tmp_path, max_duration="10ep")
    assert stopper.stopped_at == (2, 2 * BATCHES)
    assert stopper.stop_errors == [(TrainerView, 2)]
    assert_halted_at_ack(trainer, stopper.halt_ack, 2 * BATCHES, 10 * BATCHES)
    assert trainer.stopped_by["reason"] == "enough"
    # as in pytorch-accelerated, nothing but on_training_run_end follows the stop
    assert max(stopper.steps_seen) == 2 * BATCHES and stopper.run_ends == 1
    # the other callbacks hear of the stop at fit_end, before on_training_run_end
    assert observer.calls == [("on_stop_training_error", "enough"), ("on_training_run_end", None)]


# --------------------------------------------------------------------------- built-ins


@pytest.mark.parametrize("in_training, nan_from, decided_at, where", [
    (True, 10, 10, "training"),  # the 10th training batch's loss is NaN
    (False, 3, 2 * BATCHES, "validation"),  # the second evaluation's first batch is NaN
])
def test_terminate_on_nan_halts_after_a_nan_loss(tmp_path, in_training, nan_from, decided_at, where):
    callback = bounded(TerminateOnNaNCallback())
    trainer, _ = run_with_worker([callback], tmp_path, max_duration="12ep",
                                 loss_fn=NanLossFrom(nan_from, in_training))
    assert callback.triggered and callback.triggered_in == where
    assert callback.triggered_at == decided_at
    assert_halted_at_ack(trainer, callback.halt_ack, decided_at, 12 * BATCHES)
    assert "NaN" in trainer.stopped_by["reason"]


@pytest.mark.parametrize("script, options, stop_epoch, best", [
    # lower is better; 0.895 and 0.795 improve by less than the threshold; the counter resets at 0.8
    ([1.0, 0.9, 0.895, 0.8, 0.85, 0.795, 0.5],
     {"early_stopping_patience": 2, "early_stopping_threshold": 0.01}, 6, 0.8),
    # greater is better; +0.04 is below the threshold
    ([0.5, 0.6, 0.64, 0.9],
     {"early_stopping_patience": 1, "early_stopping_threshold": 0.05, "greater_is_better": True}, 3, 0.6),
])
def test_early_stopping_halts_at_the_reference_epoch(tmp_path, script, options, stop_epoch, best):
    callback = bounded(EarlyStoppingCallback(watch_metric="ScriptedScore", **options))
    trainer, _ = run_with_worker([callback], tmp_path, max_duration="10ep",
                                 eval_metrics=[ScriptedScore(script)])
    assert callback.stopped_epoch == stop_epoch
    assert callback.stopped_step == stop_epoch * BATCHES
    assert callback.best_metric == pytest.approx(best)
    assert callback.early_stopping_patience_counter == options["early_stopping_patience"]
    assert_halted_at_ack(trainer, callback.halt_ack, stop_epoch * BATCHES, 10 * BATCHES)
    # the built-ins' one halt records where it was asked for, as Composer's stoppers' does
    assert callback.halted_at.batch == stop_epoch * BATCHES and callback.halt_error is None


def test_early_stopping_watches_the_train_loss_with_no_eval_dataloader(tmp_path):
    # the train loss falls every epoch, so with greater_is_better it never improves: the first
    # epoch's value is the best, the second is one epoch without improvement (patience 1)
    callback = bounded(EarlyStoppingCallback(watch_metric="train_loss_epoch", greater_is_better=True,
                                             early_stopping_patience=1, early_stopping_threshold=0.0))
    trainer, _ = run_with_worker([callback], tmp_path, max_duration="10ep", eval_dataloader=None)
    assert callback.stopped_epoch == 2 and callback.stopped_step == 2 * BATCHES
    assert callback.early_stopping_patience_counter == 1
    assert_halted_at_ack(trainer, callback.halt_ack, 2 * BATCHES, 10 * BATCHES)


def test_early_stopping_at_the_final_evaluation_has_nothing_left_to_halt(tmp_path):
    callback = bounded(EarlyStoppingCallback(watch_metric="ScriptedScore"))
    trainer, _ = run_with_worker([callback], tmp_path, max_duration="2ep",
                                 eval_metrics=[ScriptedScore([1.0, 1.0])])
    assert callback.stopped_epoch == 2
    assert callback.halt_ack is not None and not callback.halt_ack.ok
    assert "last batch" in callback.halt_ack.error
    assert callback.halt_error == callback.halt_ack.error
    assert trainer.stopped_by is None and trainer.timestamp.batch == 2 * BATCHES


def test_save_best_model_checkpoints_each_improvement_and_keeps_the_best(tmp_path):
    save_path = tmp_path / "best" / "model.pt"
    log = MemoryLog()
    callback = bounded(SaveBestModelCallback(save_path=save_path, watch_metric="ScriptedScore",
                                             greater_is_better=True))
    trainer, _ = run_with_worker([callback], tmp_path, max_duration="5ep", destinations=[log],
                                 eval_metrics=[ScriptedScore([0.5, 0.7, 0.6, 0.65, 0.9])])
    # improvements at evaluations 1 and 2 were checkpointed; the one at the final evaluation
    # came after the trainer's last batch and could only be reported
    assert len(trainer.checkpoints) == 2
    assert all(path.endswith("-best.pt") for path in trainer.checkpoints)
    assert callback.best_checkpoint == trainer.checkpoints[1]
    assert filecmp.cmp(save_path, trainer.checkpoints[1], shallow=False)
    assert not filecmp.cmp(trainer.checkpoints[0], trainer.checkpoints[1], shallow=False)
    assert callback.saved_metric == pytest.approx(0.7)
    # after evaluation 2; on a busy machine the request may reach the trainer only at its end
    assert 2 * BATCHES <= callback.best_checkpoint_step <= 5 * BATCHES
    assert load_checkpoint(save_path)["timestamp"]["batch"] == callback.best_checkpoint_step
    assert (callback.best_metric, callback.best_metric_epoch) == (pytest.approx(0.9), 5)
    assert any("final evaluation" in text for text in log.texts)


class CollectMetrics(LogMetricsCallback):
    def __init__(self):
        self.logged = []

    def log_metrics(self, trainer, metrics):
        self.logged.append((trainer.state.timestamp.batch, metrics))


def test_log_metrics_logs_train_then_eval_metrics_and_one_jsonl_line_per_step(tmp_path):
    log, jsonl = MemoryLog(), tmp_path / "logs" / "metrics.jsonl"
    subclass = CollectMetrics()
    run_with_worker([LogMetricsCallback(jsonl_path=jsonl), subclass], tmp_path, max_duration="3ep",
                    destinations=[log],
                    eval_metrics=[torchmetrics.classification.MulticlassAccuracy(num_classes=3)])
    eval_keys = {"eval_loss_epoch", "MulticlassAccuracy"}
    assert [(step, set(m)) for step, m in log.metrics] == [
        (s * BATCHES, keys) for s in (1, 2, 3) for keys in ({"train_loss_epoch"}, eval_keys)
    ]
    # a subclass's log_metrics gets the same metrics (each callback folds the same events)
    assert subclass.logged == log.metrics
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [line["step"] for line in lines] == [8, 16, 24]
    assert [line["epoch"] for line in lines] == [1, 2, 3]
    for line, i in zip(lines, (0, 2, 4), strict=True):
        merged = {**log.metrics[i][1], **log.metrics[i + 1][1]}
        assert {k: line[k] for k in merged} == pytest.approx(merged)


def test_progress_callbacks_print_the_run_and_draw_a_bar_per_epoch(tmp_path):
    log, out = MemoryLog(), io.StringIO()
    run_with_worker([PrintProgressCallback(), ProgressBarCallback(file=out)], tmp_path,
                    max_duration="2ep", destinations=[log])
    assert log.texts == ["Starting training run", "Starting epoch 1", "Starting eval epoch",
                         "Starting epoch 2", "Starting eval epoch", "Finishing training run"]
    # each bar as last drawn: tqdm (installed with the test extras) redraws in place with \r
    bars = [line.split("\r")[-1] for line in out.getvalue().split("\n") if line]
    assert [bar.split(":")[0] for bar in bars] == ["epoch 1", "eval", "epoch 2", "eval"]
    assert [bar.split("| ")[-1].split(" ")[0] for bar in bars] == ["8/8", "2/2", "8/8", "2/2"]


# ------------------------------------------------------------------ without a training run


def test_move_modules_to_device_refuses_to_be_created_and_says_why():
    with pytest.raises(OutOfProcessError, match="another process") as raised:
        MoveModulesToDeviceCallback()
    assert "Trainer(device=" in str(raised.value)


def test_wanted_topics_are_the_overridden_hooks_and_the_run_history():
    assert EarlyStoppingCallback.hook_topics() == {"fit_start", "epoch_checkpoint"}
    assert EarlyStoppingCallback.wanted_topics() == {"fit_start", "epoch_checkpoint"} | RUN_HISTORY_TOPICS
    assert TerminateOnNaNCallback.hook_topics() == {"fit_start", "batch_end", "eval_batch_end", "eval_end"}
    assert "batch_start" not in ProgressBarCallback.wanted_topics()
    assert HookRecorder.hook_topics() == set(HOOKS) - {"eval_standalone_start", "eval_standalone_end"}

    class OwnDispatch(TrainerCallback):
        def run_event(self, event, state, logger):
            pass

    assert OwnDispatch.wanted_topics() is None


def test_built_ins_travel_to_worker_processes_and_reject_bad_options():
    for callback in (TerminateOnNaNCallback(), LogMetricsCallback(jsonl_path="m.jsonl"),
                     PrintProgressCallback(), ProgressBarCallback(), SaveBestModelCallback(),
                     EarlyStoppingCallback(early_stopping_patience=3)):
        assert type(pickle.loads(pickle.dumps(callback))) is type(callback)
    with pytest.raises(ValueError, match="early_stopping_patience"):
        EarlyStoppingCallback(early_stopping_patience=-1)
    with pytest.raises(TypeError, match="greater_is_better"):
        SaveBestModelCallback(greater_is_better="yes")


def test_the_trainer_view_is_read_only_and_says_what_a_worker_cannot_reach():
    state = State()
    view = TrainerView(state)
    with pytest.raises(AttributeError, match="another process"):
        view.model  # noqa: B018
    with pytest.raises(AttributeError, match="cannot set trainer.model"):
        view.model = None
    assert view.run_config.is_world_process_zero and view.run_history.current_epoch == 1
    with pytest.raises(AttributeError, match="run_config is read-only"):
        view.run_config.num_epochs = 3
    with pytest.raises(AttributeError, match="cannot set trainer.run_history"):
        view.run_history = None


@pytest.mark.parametrize("reset_on_train, stop_epoch, best", [
    (False, 3, 0.9),  # the first fit's best (0.9) still stands: 0.95 at epoch 3 is no improvement
    (True, 4, 0.95),  # forgotten at the second fit_start: 0.95 is the new first best
])
def test_reset_on_train_decides_whether_a_second_fit_remembers_the_best(
        tmp_path, reset_on_train, stop_epoch, best):
    import threading

    from helpers.data import dataset
    from helpers.harness import Paced

    from offloop.workers import CallbackRuntime

    callback = bounded(EarlyStoppingCallback(watch_metric="ScriptedScore", early_stopping_patience=1,
                                             reset_on_train=reset_on_train))
    trainer = Trainer(Paced(), DataLoader(dataset(), batch_size=8, shuffle=True), "2ep",
                      loss_fn=torch.nn.functional.cross_entropy,
                      eval_dataloader=DataLoader(dataset(32, seed=2), batch_size=16),
                      eval_metrics=[ScriptedScore([1.0, 0.9, 0.95, 0.96])], run_dir=tmp_path / "run", seed=3)
    # one worker for both fits: it stays after the first fit_end, until the stream closes
    worker = CallbackRuntime(str(tmp_path / "run"), [callback], destinations=[MemoryLog()],
                             heartbeat_timeout=30, exit_on_fit_end=False)
    worker.connect()
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        trainer.fit()
        trainer.fit(duration="4ep")
    finally:
        trainer.close()
        thread.join(timeout=60)
    assert not thread.is_alive()
    assert callback.stopped_epoch == stop_epoch and callback.best_metric == pytest.approx(best)
    if not reset_on_train:
        assert_halted_at_ack(trainer, callback.halt_ack, 3 * BATCHES, 4 * BATCHES)
