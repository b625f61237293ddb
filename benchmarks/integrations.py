"""Integrations benchmark: Lightning with its callbacks in-process, against Lightning with
offloop's OffloopCallback running the like set out of process, both against the
hand-written loop of benchmarks/loggers.py.

The real-size model of trainer_overhead.py (MLP 784-512-512-10, batch 64, SGD, one torch
thread, CPU), epochs of 100 batches, each followed by an evaluation (4 batches) and a
checkpoint. Cases, each a whole fit of 1 + E epochs (the first discarded as warm-up),
taking turns in rounds:

  hand               loggers.py's hand-written loop: train, evaluate, checkpoint; no logging
  lightning_bare     Lightning with no callback, no logger, no checkpointing: what Lightning
                     itself costs, the floor for what a callback set adds
  lightning_plain    Lightning with ThroughputMonitor, LearningRateMonitor, EarlyStopping
                     (on val_loss, never firing), ModelCheckpoint every epoch and
                     TensorBoardLogger logging the loss every step (log_every_n_steps=1)
  lightning_offloop  Lightning with OffloopCallback([SpeedMonitor, LRMonitor, EarlyStopper,
                     CheckpointSaver every epoch], loggers=[TensorboardLogger]): the like set
                     in one worker process; Lightning's own logger and checkpointing off
  lightning_offloop_publish   Lightning with an OffloopCallback and no offloop callback or
                     logger: what publishing every event costs the training thread alone
  lightning_heavy_inprocess  lightning_plain + a callback sleeping 5 ms every batch and
                     50 ms every epoch (a slow logger, an upload), in-process
  lightning_heavy_offloop    lightning_offloop + that callback in a worker of its own

A case's figure is an epoch's wall time over its batches: from the first batch fetched in
one epoch to the first fetched in the next, so it holds the epoch's steps, evaluation,
checkpoint and every hook. Lightning's start and end of a fit are outside it. Before each
case the machine is let settle until its CPUs are idle (quiet.py), so what a case leaves
running (a TensorBoard writer, a worker finishing its callbacks) is not charged to the
next one.

What it does not show: a GPU; Lightning's DDP (tested, not timed); spare cores (the
workers share two cores with training); epochs of realistic length (100 batches:
evaluation and checkpoints weigh more than in most runs, for every case alike).

Prints one JSON object per case and, last, a summary with the ratios to `hand`.

Run: python benchmarks/integrations.py [--rounds N] [--epochs N] [--batches N]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from loggers import EVAL_BATCHES, Epoch, HandLoop, make_batches, make_model  # beside this script
from quiet import wait_for_quiet
from trainer_overhead import SEED

from offloop.callbacks import CheckpointSaver, EarlyStopper, LRMonitor, SpeedMonitor
from offloop.integrations.lightning import OffloopCallback
from offloop.loggers import TensorboardLogger
from offloop.workers import Callback

TARGET = 1.10  # issue 25: lightning_offloop against the hand-written loop
SLOW_BATCH, SLOW_EPOCH = 0.005, 0.05  # seconds the slow callback spends


class Stamped(Epoch):
    """The batches, with perf_counter read at the first fetch of every pass (one per epoch;
    Lightning also makes an iterator it never fetches from, which is not counted)."""

    def __init__(self, batches: list) -> None:
        super().__init__(batches)
        self.starts: list[float] = []

    def __iter__(self):
        batches, starts = self.batches, self.starts
        for i, batch in enumerate(batches):
            if i == 0:
                starts.append(time.perf_counter())
            yield batch


class Module(pl.LightningModule):
    """The benchmark's MLP and SGD; `log_train` logs the loss every step (Lightning's logger)."""

    def __init__(self, log_train: bool) -> None:
        super().__init__()
        self.net, self.opt = make_model()
        self.log_train = log_train

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        if self.log_train:
            self.log("train_loss", loss, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y))

    def configure_optimizers(self):
        return self.opt


class SlowInProcess(pl.Callback):
    def on_train_batch_end(self, *args) -> None:
        time.sleep(SLOW_BATCH)

    def on_train_epoch_end(self, *args) -> None:
        time.sleep(SLOW_EPOCH)


class SlowOffloop(Callback):
    def batch_end(self, state, logger) -> None:
        time.sleep(SLOW_BATCH)

    def epoch_end(self, state, logger) -> None:
        time.sleep(SLOW_EPOCH)


def lightning_plain(workdir: str, heavy: bool) -> tuple[pl.Trainer, pl.LightningModule]:
    from lightning.pytorch.callbacks import (
        EarlyStopping,
        LearningRateMonitor,
        ModelCheckpoint,
        ThroughputMonitor,
    )
    from lightning.pytorch.loggers import TensorBoardLogger

    callbacks = [ThroughputMonitor(batch_size_fn=lambda batch: batch[0].size(0)),
                 LearningRateMonitor(logging_interval="step"),
                 EarlyStopping("val_loss", patience=10_000),
                 ModelCheckpoint(dirpath=os.path.join(workdir, "checkpoints"), every_n_epochs=1)]
    callbacks += [SlowInProcess()] if heavy else []
    trainer = pl.Trainer(accelerator="cpu", devices=1, callbacks=callbacks, log_every_n_steps=1,
                         logger=TensorBoardLogger(os.path.join(workdir, "tb")), **QUIET)
    return trainer, Module(log_train=True)


def lightning_bare(workdir: str, heavy: bool) -> tuple[pl.Trainer, pl.LightningModule]:
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, **QUIET)
    return trainer, Module(log_train=False)


def lightning_offloop_publish(workdir: str, heavy: bool) -> tuple[pl.Trainer, pl.LightningModule]:
    offloop = OffloopCallback(run_dir=os.path.join(workdir, "run"))
    trainer = pl.Trainer(accelerator="cpu", devices=1, callbacks=[offloop], logger=False,
                         enable_checkpointing=False, **QUIET)
    return trainer, Module(log_train=False)


def lightning_offloop(workdir: str, heavy: bool) -> tuple[pl.Trainer, pl.LightningModule]:
    callbacks = [SpeedMonitor(window_size=100), LRMonitor(), EarlyStopper("val_loss", "eval", patience=10_000),
                 CheckpointSaver(folder=os.path.join(workdir, "checkpoints"), save_interval="1ep",
                                 num_checkpoints_to_keep=1)]
    callbacks += [SlowOffloop().in_own_process()] if heavy else []
    offloop = OffloopCallback(callbacks, loggers=[TensorboardLogger(log_dir=os.path.join(workdir, "tb"))],
                              run_dir=os.path.join(workdir, "run"), worker_shutdown_timeout=1)
    trainer = pl.Trainer(accelerator="cpu", devices=1, callbacks=[offloop], logger=False,
                         enable_checkpointing=False, **QUIET)
    return trainer, Module(log_train=False)


QUIET = dict(enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)


def run_lightning(build, workdir: str, heavy: bool, epochs: int, train: list, evaluation: Epoch) -> list[float]:
    """One fit of 1 + `epochs` epochs; each timed epoch's wall time over its batches, in µs."""
    torch.manual_seed(SEED)
    loader = Stamped(train)
    trainer, module = build(workdir, heavy)
    trainer.fit_loop.max_epochs = epochs + 2  # one more epoch start ends the last timed epoch
    trainer.fit(module, loader, evaluation)
    starts = loader.starts
    return [(b - a) * 1e6 / len(train) for a, b in zip(starts[1:epochs + 1], starts[2:epochs + 2], strict=True)]


def run_hand(workdir: str, epochs: int, train: list, evaluation: Epoch) -> list[float]:
    loop, times = HandLoop(Epoch(train), evaluation, workdir, False, False), []
    for epoch in range(epochs + 1):
        start = time.perf_counter()
        loop.epoch()
        if epoch:
            times.append((time.perf_counter() - start) * 1e6 / len(train))
    loop.close()
    return times


CASES = {
    "hand": None,
    "lightning_bare": (lightning_bare, False),
    "lightning_plain": (lightning_plain, False),
    "lightning_offloop": (lightning_offloop, False),
    "lightning_offloop_publish": (lightning_offloop_publish, False),
    "lightning_heavy_inprocess": (lightning_plain, True),
    "lightning_heavy_offloop": (lightning_offloop, True),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every case, taking turns")
    parser.add_argument("--epochs", type=int, default=4, help="timed epochs per fit")
    parser.add_argument("--batches", type=int, default=100, help="training batches per epoch")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated cases ('hand' always runs)")
    args = parser.parse_args()
    cases = {name: CASES[name] for name in ["hand", *args.cases.split(",")] if name in CASES}
    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    train, evaluation = make_batches(args.batches, SEED), Epoch(make_batches(EVAL_BATCHES, SEED + 1))
    root = tempfile.mkdtemp(prefix="offloop-bench-integrations-")
    per_step: dict[str, list[float]] = {name: [] for name in cases}
    waited: list[float] = []
    try:
        for r in range(args.rounds):
            for name, case in cases.items():
                waited.append(wait_for_quiet())  # the case before it has finished its leftover work
                workdir = os.path.join(root, f"{name}-{r}")
                if case is None:
                    per_step[name] += run_hand(workdir, args.epochs, train, evaluation)
                else:
                    per_step[name] += run_lightning(case[0], workdir, case[1], args.epochs, train, evaluation)
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                f"{name} {statistics.fmean(v):.0f} us" for name, v in per_step.items()), file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    lines = {}
    for name, values in per_step.items():
        lines[name] = {"case": name, "epochs": len(values), "step_mean_us": round(statistics.fmean(values), 1),
                       "step_median_us": round(statistics.median(values), 1)}
        print(json.dumps(lines[name]), flush=True)
    hand = lines["hand"]
    summary: dict = {}
    if len(lines) < len(CASES):  # a subset: the ratios to the hand-written loop alone
        print(json.dumps({f"{name}_ratio": round(line["step_mean_us"] / hand["step_mean_us"], 3)
                          for name, line in lines.items()}))
        return
    for name, line in lines.items():
        if name != "hand":
            short = name.removeprefix("lightning_")
            summary[f"lightning_{short}_ratio"] = round(line["step_mean_us"] / hand["step_mean_us"], 3)
            summary[f"lightning_{short}_ratio_median"] = round(line["step_median_us"] / hand["step_median_us"], 3)
    summary["slow_callback_cost_inprocess"] = round(
        lines["lightning_heavy_inprocess"]["step_mean_us"] / lines["lightning_plain"]["step_mean_us"], 3)
    summary["slow_callback_cost_offloop"] = round(
        lines["lightning_heavy_offloop"]["step_mean_us"] / lines["lightning_offloop"]["step_mean_us"], 3)
    summary["publish_over_bare"] = round(
        lines["lightning_offloop_publish"]["step_mean_us"] / lines["lightning_bare"]["step_mean_us"], 3)
    summary["offloop_over_bare"] = round(
        lines["lightning_offloop"]["step_mean_us"] / lines["lightning_bare"]["step_mean_us"], 3)
    summary["plain_over_bare"] = round(
        lines["lightning_plain"]["step_mean_us"] / lines["lightning_bare"]["step_mean_us"], 3)
    summary["target"] = {"lightning_offloop_ratio": TARGET, "met": summary["lightning_offloop_ratio"] <= TARGET}
    summary |= {"quiet_wait_s_median": round(statistics.median(waited), 2), "quiet_wait_s_max": round(max(waited), 2)}
    summary |= {"rounds": args.rounds, "epochs": args.epochs, "batches_per_epoch": args.batches,
                "eval_batches": EVAL_BATCHES, "torch": torch.__version__, "lightning": pl.__version__,
                "threads": torch.get_num_threads()}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
