"""The monitors on one real run (SpeedMonitor, LRMonitor, OptimizerMonitor, GradMonitor,
MemoryMonitor, RuntimeEstimator): the documented keys, with values checked against
what the run did. CUDA-only inputs (allocator stats, device names) come as messages."""

from __future__ import annotations

import copy
import math
import resource
import time

import pytest
import torch
from helpers.data import dataset
from helpers.harness import MemoryLog, classifier, run_with_worker
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from offloop.bus import Message, RunInfo
from offloop.workers import Callback, CallbackRuntime
from offloop.workers.callbacks import (
    GradMonitor,
    LRMonitor,
    MemoryMonitor,
    OptimizerMonitor,
    RuntimeEstimator,
    SpeedMonitor,
)

EPOCHS, BATCHES, BATCH_SIZE, TOKENS = 3, 8, 8, 5  # TOKENS per sample
FLOPS = 1.0e6  # per batch
PEAK = 1.0e9
STEP_SECONDS = 0.008


class FlopsModel(nn.Module):
    """The harness's classifier with Composer's flops_per_batch, taking STEP_SECONDS per step."""

    def __init__(self):
        super().__init__()
        self.net = classifier()

    def forward(self, x):
        if self.training:
            time.sleep(STEP_SECONDS)
        return self.net(x)

    def flops_per_batch(self, batch):
        return FLOPS


class Hparams(MemoryLog):
    def __init__(self):
        super().__init__()
        self.hparams: list[dict] = []

    def log_hyperparameters(self, hparams):
        self.hparams.append(dict(hparams))


class WallTimes(Callback):
    """The trainer's publish time of each batch_end, by batch, and how long each eval took."""

    def __init__(self):
        self.at: dict[int, float] = {}
        self.started: dict[int, float] = {}
        self.evals: list[float] = []

    def batch_start(self, state, logger):
        self.started[state.timestamp.batch + 1] = state.wall_time

    def batch_end(self, state, logger):
        self.at[state.timestamp.batch] = state.wall_time

    def eval_start(self, state, logger):
        self.evals.append(-state.wall_time)

    def eval_end(self, state, logger):
        self.evals[-1] += state.wall_time


class Run:
    def __init__(self, log, trainer, reference, walls):
        self.log, self.trainer, self.reference, self.walls = log, trainer, reference, walls

    def by_step(self, key: str) -> dict[int, float]:
        return {step: m[key] for step, m in self.log.metrics if key in m}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Run:
    model = FlopsModel()
    reference = copy.deepcopy(model.net)
    params = list(model.net.parameters())
    opt = torch.optim.SGD([{"params": params[:2], "lr": 0.1}, {"params": params[2:], "lr": 0.01}])
    log, walls = Hparams(), WallTimes()
    callbacks = [SpeedMonitor(window_size=4, gpu_flops_available=PEAK, time_unit="seconds"),
                 LRMonitor(), OptimizerMonitor(), OptimizerMonitor(interval="4ba", only_global=True),
                 GradMonitor(log_layer_grad_norms=True),
                 MemoryMonitor(), RuntimeEstimator(time_unit="seconds"), walls]
    trainer, _ = run_with_worker(
        callbacks, tmp_path_factory.mktemp("monitors"), max_duration=f"{EPOCHS}ep", destinations=[log],
        model=model, optimizers=opt, schedulers=torch.optim.lr_scheduler.StepLR(opt, 4, gamma=0.5),
        train_dataloader=DataLoader(dataset(), batch_size=BATCH_SIZE), per_param_grad_norms=True,
        num_tokens_fn=lambda batch: batch[0].shape[0] * TOKENS)
    return Run(log, trainer, reference, walls)


TOTAL = EPOCHS * BATCHES


def test_lr_monitor_logs_each_group_of_each_optimizer(run):
    for group, base in ((0, 0.1), (1, 0.01)):
        logged = run.by_step(f"lr-SGD/group{group}")
        assert sorted(logged) == list(range(1, TOTAL + 1))
        # StepLR(4, 0.5) has stepped once per batch by batch_end
        assert all(lr == pytest.approx(base * 0.5 ** (step // 4)) for step, lr in logged.items())


def test_lr_monitor_names_each_of_several_optimizers(tmp_path):
    model, log = classifier(), MemoryLog()
    optimizers = [torch.optim.SGD(model[0].parameters(), lr=0.1),
                  torch.optim.Adam(model[2].parameters(), lr=0.003)]
    run_with_worker([LRMonitor()], tmp_path, max_duration="2ba", model=model, optimizers=optimizers,
                    destinations=[log])
    assert log.metrics == [(s, {"lr-SGD/group0": 0.1, "lr-Adam/group0": 0.003}) for s in (1, 2)]


def test_optimizer_monitor_logs_the_global_and_per_parameter_grad_norms(run):
    names = [f"net.{n}" for n, _ in run.reference.named_parameters()]
    global_norms = run.by_step("l2_norm/grad/global")
    assert sorted(global_norms) == list(range(1, TOTAL + 1))
    for step, norm in global_norms.items():
        per_param = [run.by_step(f"l2_norm/grad/{n}")[step] for n in names]
        assert norm == pytest.approx(math.sqrt(sum(v * v for v in per_param)), rel=1e-5)
    # the first batch, recomputed here from the untrained model (the loader does not shuffle)
    x, y = dataset()[:BATCH_SIZE]
    F.cross_entropy(run.reference(x), y).backward()
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in run.reference.parameters()]))
    assert global_norms[1] == pytest.approx(expected.item(), rel=1e-5)


def test_optimizer_monitor_interval_and_only_global(run):
    # the second monitor logs the global norm again every 4 batches, and no per-parameter norms
    twice = [step for step in range(1, TOTAL + 1)
             if sum(1 for s, m in run.log.metrics if s == step and "l2_norm/grad/global" in m) == 2]
    assert twice == list(range(4, TOTAL + 1, 4))
    per_param = [s for s, m in run.log.metrics if any(k.startswith("l2_norm/grad/net.") for k in m)]
    assert per_param == list(range(1, TOTAL + 1))


def test_grad_monitor_uses_composer_s_older_keys(run):
    assert run.by_step("grad_l2_norm/step") == run.by_step("l2_norm/grad/global")
    assert run.by_step("layer_grad_l2_norm/net.0.weight") == run.by_step("l2_norm/grad/net.0.weight")


def test_speed_monitor_logs_throughput_mfu_and_wall_clock(run):
    batches_per_sec = run.by_step("throughput/batches_per_sec")
    assert sorted(batches_per_sec) == list(range(5, TOTAL + 1))  # once the window of 4 is full
    for step, bps in batches_per_sec.items():
        assert 0 < bps < 1 / STEP_SECONDS  # no faster than the model's sleep allows
        assert run.by_step("throughput/samples_per_sec")[step] == pytest.approx(bps * BATCH_SIZE)
        assert run.by_step("throughput/tokens_per_sec")[step] == pytest.approx(bps * BATCH_SIZE * TOKENS)
        assert run.by_step("throughput/device/batches_per_sec")[step] == pytest.approx(bps)
        flops = run.by_step("throughput/flops_per_sec")[step]
        assert flops == pytest.approx(bps * FLOPS)
        assert run.by_step("throughput/device/mfu")[step] == pytest.approx(flops / PEAK)
    # the window's rate is the rate between the publish times of its ends (no eval inside)
    w = run.walls.at
    assert batches_per_sec[8] == pytest.approx(4 / (w[8] - w[4]), rel=1e-6)
    train, val, total = (run.by_step(f"wall_clock/{k}") for k in ("train", "val", "total"))
    assert sorted(train) == list(range(1, TOTAL + 1))
    assert all(train[s] < train[s + 1] for s in range(1, TOTAL))
    assert val[BATCHES] == 0 and val[BATCHES + 1] > 0  # the first evaluation ran after batch 8
    assert all(total[s] == pytest.approx(train[s] + val[s]) for s in train)
    assert train[TOTAL] >= TOTAL * STEP_SECONDS


def test_memory_monitor_logs_the_trainer_s_peak_rss_on_cpu(run):
    rss = run.by_step("memory/peak_rss_mem")
    assert sorted(rss) == list(range(1, TOTAL + 1))
    now_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # the trainer is us
    assert 0.5 * now_gb <= rss[TOTAL] <= now_gb * 1.001
    assert all(rss[s] <= rss[s + 1] for s in range(1, TOTAL))  # a peak never falls


def test_runtime_estimator_counts_down_to_zero(run):
    remaining = run.by_step("wall_clock/remaining_estimate")
    assert remaining == run.by_step("time/remaining_estimate")
    assert sorted(remaining) == list(range(2, TOTAL + 1))  # skip_batches=1
    assert {"time/remaining_estimate_unit": "seconds"} in run.log.hparams
    # at the last batch only evaluation is left: two done (one every 15/48 of the run since
    # the clock started), 46/15 expected in all, at the second one's time (the first left out)
    assert remaining[TOTAL] == pytest.approx(run.walls.evals[1] * (46 / 15 - 2), rel=1e-6)
    assert remaining[2] > remaining[TOTAL]
    # Composer's estimate at batch 12, from the trainer's times: the clock started at batch 2
    # (1/24 done); training time since (less the first evaluation) extrapolated to the 12/24
    # left, plus evaluations at the first one's duration and observed frequency (one per 7/24)
    first_eval = run.walls.evals[0]
    train_time = run.walls.at[12] - run.walls.started[2] - first_eval
    expected = train_time / (11 / 24) * (12 / 24) + first_eval * ((23 / 24) / (7 / 24) - 1)
    assert remaining[12] == pytest.approx(expected, rel=1e-6)


# ------------------------------------------------ inputs a CPU run cannot produce


def dispatch(callbacks, messages) -> MemoryLog:
    log = MemoryLog()
    info = RunInfo("r", "r", 0, 0.0, {"events": "tcp://127.0.0.1:1"})
    worker = CallbackRuntime(info, callbacks, destinations=[log])
    for seq, (topic, t, ts, data) in enumerate(messages):
        worker.dispatch(Message(topic, "ev", "r", "p", 0, seq, seq, t, ts, data))
    assert worker.logger.wait(timeout=10)  # the destinations are called on a thread of their own
    return log


def test_memory_monitor_on_cuda_logs_allocator_stats_in_gigabytes():
    memory = {"allocated_bytes": 1_234_567_890, "reserved_bytes": 2_000_000_000,
              "max_allocated_bytes": 1_500_000_000}
    log = dispatch([MemoryMonitor(), MemoryMonitor({"allocated_bytes.all.peak": "peak"})],
                   [("batch_end", 1.0, (0, 1, 1, 8, 0), {"memory": memory})])
    assert log.metrics == [  # both monitors' values of the step, in one call to the destination
        (1, {"memory/current_allocated_mem": 1.2346, "memory/current_reserved_mem": 2.0,
             "memory/peak_allocated_mem": 1.5, "memory/peak": 1.5}),
    ]


def test_optimizer_monitor_logs_nothing_for_a_batch_whose_norms_it_missed():
    log = dispatch([OptimizerMonitor()], [
        ("grad_norms", 1.0, (0, 0, 0, 0, 0), {"grad_norm": 2.0}),
        ("after_train_batch", 1.0, (0, 0, 0, 0, 0), {}),
        ("batch_end", 1.1, (0, 1, 1, 8, 0), {}),
        # the after_train_batch of batch 2 was lost on the way (a counted gap)
        ("batch_end", 1.2, (0, 2, 2, 16, 0), {}),
    ])
    assert log.metrics == [(1, {"l2_norm/grad/global": 2.0})]


def test_speed_monitor_finds_peak_flops_from_the_published_device_name():
    monitor = SpeedMonitor(window_size=1)
    config = {"device_name": "NVIDIA H100 80GB HBM3", "precision": "amp_bf16", "world_size": 2}
    log = dispatch([monitor], [
        ("fit_start", 10.0, (0, 0, 0, 0, 0), {"config": config}),
        ("batch_end", 11.0, (0, 1, 1, 8, 0), {"flops": 2.0e14}),
        ("batch_end", 11.5, (0, 2, 2, 16, 0), {"flops": 2.0e14}),
    ])
    assert monitor.gpu_flops_available == pytest.approx(1.979e15 / 2)
    last = log.metrics[-1][1]
    assert last["throughput/batches_per_sec"] == pytest.approx(2.0)
    assert last["throughput/samples_per_sec"] == pytest.approx(2 * 8 * 2)  # both ranks' samples
    assert last["throughput/device/flops_per_sec"] == pytest.approx(4.0e14)
    assert last["throughput/flops_per_sec"] == pytest.approx(8.0e14)
    assert last["throughput/device/mfu"] == pytest.approx(4.0e14 / (1.979e15 / 2))


def test_lr_monitor_with_group_counts_unknown_or_published():
    two_sgd_groups_and_adam = ("batch_end", 1.0, (0, 1, 1, 8, 0), {"lr": [0.1, 0.01, 0.003]})
    unknown = {"optimizers": [{"name": "SGD"}, {"name": "Adam"}]}
    known = {"optimizers": [{"name": "SGD", "param_groups": 2}, {"name": "Adam", "param_groups": 1}]}
    log = dispatch([LRMonitor()], [("fit_start", 0.5, (0,) * 5, {"config": unknown}), two_sgd_groups_and_adam,
                                   ("fit_start", 0.5, (0,) * 5, {"config": known}), two_sgd_groups_and_adam])
    assert [m for _, m in log.metrics] == [
        {"lr-SGD+Adam/group0": 0.1, "lr-SGD+Adam/group1": 0.01, "lr-SGD+Adam/group2": 0.003},
        {"lr-SGD/group0": 0.1, "lr-SGD/group1": 0.01, "lr-Adam/group0": 0.003},
    ]
