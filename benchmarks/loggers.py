"""Loggers benchmark: what TensorBoard and wandb cost a training step, called the usual way
on the training thread, against offloop's TensorboardLogger and WandBLogger in a worker.

The real-size model of trainer_overhead.py (MLP 784-512-512-10, batch 64, SGD, one torch
thread, CPU), epochs of 100 batches, each followed by an evaluation (4 batches, accuracy
with torchmetrics) and a checkpoint (model and optimizer, written to a temporary file and
renamed into place). Cases, taking turns:

  plain         the hand-written loop: train, evaluate, checkpoint; no logging
  tensorboard   plain + SummaryWriter.add_scalar x4 every step (loss, lr, samples/s,
                batches/s; the loss read with .item()) and the accuracy each epoch
  wandb         plain + run.log({the same 4}) every step (offline mode), accuracy each epoch
  tb_wandb      plain + both: what the offloop case below replaces
  offloaded     plain + both, moved off the loop the least way: the loop sends the same 4
                values a step (and the accuracy) down a ZeroMQ PUSH socket, without
                waiting, to a process of its own at nice 10 (as offloop's workers) that
                calls TensorBoard and wandb with them; the floor of the offloop case
  offloop       the Trainer with SpeedMonitor, LRMonitor, EarlyStopper (on the accuracy,
                never firing), CheckpointSaver every epoch, TensorboardLogger and
                WandBLogger (offline): the callbacks and loggers in one worker process
  offloop_bare  the Trainer with the same evaluation and a CheckpointSaver, no other
                callbacks and no loggers

The cases take turns in rounds; at each turn a case trains a block of consecutive epochs
(3 by default: what its loggers and workers leave running after an epoch lands on its own
next epoch, as in a real run), then the next case waits for idle CPUs (quiet.py), so no
case is charged for another's leftover work. A block's figure is its wall time (training,
evaluations, checkpoints) over its batches. The Trainer trains a block with one
`fit(duration=...)`, so its figure also holds a fit_start and a fit_end per block that a
real run pays once. The hand-written cases also report the logging calls' own time on the
training thread, per step (mean and p99).

What it does not show: a GPU (where `.item()` is also a device sync); a tracking server
over a network (wandb runs offline, TensorBoard writes a local file); spare cores (the
worker shares two cores with training, and wandb's offline service process runs in every
wandb case); epochs of realistic length (100 batches: evaluation and checkpoints weigh
more here than in most runs, for every case alike).

Prints one JSON object per case and, last, a summary with the ratios to `plain`.

Run: python benchmarks/loggers.py [--rounds N] [--block N] [--batches N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import msgpack
import torch
import torch.nn.functional as F
import torchmetrics
import trainer_overhead  # beside this script: its large model
import zmq
from quiet import wait_for_quiet

from offloop.callbacks import CheckpointSaver, EarlyStopper, LRMonitor, SpeedMonitor
from offloop.loggers import TensorboardLogger, WandBLogger
from offloop.trainer import Trainer

SEED, LR, EVAL_BATCHES = trainer_overhead.SEED, trainer_overhead.LR, 4
WIDTHS, BATCH = trainer_overhead.SIZES["large"]
TARGET = 1.05  # issue 23: the like set with both loggers, against the hand-written loop


class Epoch:
    """A fixed list of batches as a dataloader: every pass yields all of them."""

    def __init__(self, batches: list) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        return iter(self.batches)


def make_batches(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, WIDTHS[0], generator=gen), torch.randint(0, WIDTHS[-1], (BATCH,), generator=gen))
            for _ in range(n)]


def make_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    return trainer_overhead.make_model("large")  # the same model, seed and optimizer


#: the offloaded case's logging process: TensorBoard and wandb called the usual way with
#: what the loop sends, until it sends b"end"
OFFLOADED_LOGGING = """
import os, sys, msgpack, zmq
os.nice(10)
from torch.utils.tensorboard import SummaryWriter
import wandb
endpoint, workdir, lr = sys.argv[1], sys.argv[2], float(sys.argv[3])
writer = SummaryWriter(os.path.join(workdir, "tb"))
run = wandb.init(project="offloop-bench", mode="offline", dir=workdir, config={"lr": lr},
                 settings=wandb.Settings(silent=True))
sock = zmq.Context().socket(zmq.PULL)
sock.connect(endpoint)
while (message := sock.recv()) != b"end":
    step, values = msgpack.unpackb(message)
    for key, value in values.items():
        writer.add_scalar(key, value, step)
    run.log(values, step=step)
writer.close()
run.finish()
"""


class Offloaded:
    """The offloaded case's sender: `send(step, values)` never waits (a full queue drops
    and counts); the logging process is ready once it has taken a first message."""

    def __init__(self, workdir: str) -> None:
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.PUSH)
        self.sock.sndhwm = 10_000
        self.sock.bind("tcp://127.0.0.1:*")
        self.process = subprocess.Popen([sys.executable, "-c", OFFLOADED_LOGGING, self.sock.last_endpoint.decode(),
                                         workdir, str(LR)])
        self.sock.sndtimeo = 60_000
        try:  # waits until the process has connected (after wandb.init): only here
            self.sock.send(msgpack.packb((0, {})))
        except zmq.Again:
            self.process.kill()
            raise RuntimeError("the offloaded case's logging process did not connect within 60 s") from None
        self.drops = 0

    def send(self, step: int, values: dict) -> None:
        try:
            self.sock.send(msgpack.packb((step, values)), zmq.NOBLOCK)
        except zmq.Again:
            self.drops += 1

    def close(self) -> int:
        try:
            self.sock.send(b"end")  # behind every value sent: the process logs them all first
            self.process.wait(timeout=120)
        except (zmq.Again, subprocess.TimeoutExpired):
            self.process.kill()
            self.process.wait()
        self.sock.close(linger=0)
        self.context.term()
        return self.drops


class HandLoop:
    """A hand-written epoch: train, evaluate, checkpoint; `tensorboard` and `wandb` log the
    way their users write it, timed on the training thread."""

    def __init__(self, train: Epoch, evaluation: Epoch, workdir: str, tensorboard: bool, wandb: bool,
                 offloaded: bool = False) -> None:
        self.model, self.opt = make_model()
        self.train, self.evaluation, self.workdir = train, evaluation, workdir
        os.makedirs(workdir, exist_ok=True)
        self.accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=WIDTHS[-1])
        self.writer = self.run = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(os.path.join(workdir, "tb"))
        if wandb:
            import wandb as wandb_module

            self.run = wandb_module.init(project="offloop-bench", mode="offline", dir=workdir,
                                         config={"lr": LR}, settings=wandb_module.Settings(silent=True))
        self.offloaded = Offloaded(workdir) if offloaded else None
        self.step = 0
        self.log_us: list[float] = []

    def run_epochs(self, epochs: int) -> None:
        for _ in range(epochs):
            self.epoch()

    def epoch(self) -> None:
        model, opt, clock = self.model, self.opt, time.perf_counter
        model.train()
        last = clock()
        for x, y in self.train:
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            self.step += 1
            if self.writer is not None or self.run is not None or self.offloaded is not None:
                start = clock()
                elapsed, last = start - last, start
                values = {"loss/train/total": loss.item(), "lr-SGD/group0": opt.param_groups[0]["lr"],
                          "throughput/samples_per_sec": BATCH / elapsed, "throughput/batches_per_sec": 1 / elapsed}
                if self.writer is not None:
                    for key, value in values.items():
                        self.writer.add_scalar(key, value, self.step)
                if self.run is not None:
                    self.run.log(values, step=self.step)
                if self.offloaded is not None:
                    self.offloaded.send(self.step, values)
                self.log_us.append((clock() - start) * 1e6)
        model.eval()
        with torch.no_grad():
            for x, y in self.evaluation:
                self.accuracy.update(model(x), y)
        accuracy = self.accuracy.compute().item()
        self.accuracy.reset()
        if self.writer is not None:
            self.writer.add_scalar("metrics/eval/MulticlassAccuracy", accuracy, self.step)
        if self.run is not None:
            self.run.log({"metrics/eval/MulticlassAccuracy": accuracy}, step=self.step)
        if self.offloaded is not None:
            self.offloaded.send(self.step, {"metrics/eval/MulticlassAccuracy": accuracy})
        path = os.path.join(self.workdir, "checkpoint.pt")
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": self.step}, path + ".tmp")
        os.replace(path + ".tmp", path)

    def close(self) -> dict:
        if self.writer is not None:
            self.writer.close()
        if self.run is not None:
            self.run.finish()
        drops = {"offloaded_drops": self.offloaded.close()} if self.offloaded is not None else {}
        if not self.log_us:
            return {}
        ordered = sorted(self.log_us)
        return {"log_call_mean_us": round(statistics.fmean(ordered), 1),
                "log_call_median_us": round(statistics.median(ordered), 1),
                "log_call_p99_us": round(ordered[int(len(ordered) * 0.99)], 1), **drops}


class OffloopLoop:
    """The Trainer, built once; each block is one more fit() of its epochs."""

    def __init__(self, train: Epoch, evaluation: Epoch, workdir: str, loggers: bool) -> None:
        model, opt = make_model()
        callbacks = [CheckpointSaver(folder=os.path.join(workdir, "checkpoints"), save_interval="1ep",
                                     num_checkpoints_to_keep=1)]
        destinations = []
        if loggers:
            callbacks = [SpeedMonitor(window_size=100), LRMonitor(),
                         EarlyStopper("MulticlassAccuracy", "eval", patience=10_000), *callbacks]
            destinations = [TensorboardLogger(log_dir=os.path.join(workdir, "tb")),
                            WandBLogger(project="offloop-bench", init_kwargs={"mode": "offline", "dir": workdir})]
        self.trainer = Trainer(model, train, max_duration="1ep", loss_fn=F.cross_entropy, optimizers=opt,
                               eval_dataloader=evaluation,
                               eval_metrics=torchmetrics.classification.MulticlassAccuracy(num_classes=WIDTHS[-1]),
                               callbacks=callbacks, loggers=destinations, run_dir=os.path.join(workdir, "run"),
                               run_name="bench", hparams={"lr": LR}, seed=SEED)
        self.epochs = 0

    def run_epochs(self, epochs: int) -> None:
        self.epochs += epochs
        self.trainer.fit(duration=f"{self.epochs}ep")

    def close(self) -> dict:
        drops = self.trainer.publisher.stats.drops if self.trainer.publisher is not None else 0
        self.trainer.close()
        reports = [worker.report for worker in self.trainer.workers.workers]
        return {"publisher_drops": drops, "worker_gaps": sum((r or {}).get("gaps", 0) for r in reports)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=10, help="timed blocks per case, taking turns")
    parser.add_argument("--block", type=int, default=3, help="consecutive epochs a case trains at its turn")
    parser.add_argument("--batches", type=int, default=100, help="training batches per epoch")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("WANDB_SILENT", "true")
    train, evaluation = Epoch(make_batches(args.batches, SEED)), Epoch(make_batches(EVAL_BATCHES, SEED + 1))
    root = tempfile.mkdtemp(prefix="offloop-bench-loggers-")
    try:
        cases = {}
        for name, tb, wb in (("plain", False, False), ("tensorboard", True, False), ("wandb", False, True),
                             ("tb_wandb", True, True)):
            cases[name] = HandLoop(train, evaluation, os.path.join(root, name), tb, wb)
        cases["offloaded"] = HandLoop(train, evaluation, os.path.join(root, "offloaded"), False, False, offloaded=True)
        cases["offloop"] = OffloopLoop(train, evaluation, os.path.join(root, "offloop"), loggers=True)
        cases["offloop_bare"] = OffloopLoop(train, evaluation, os.path.join(root, "offloop_bare"), loggers=False)
        per_step: dict[str, list[float]] = {name: [] for name in cases}
        waited: list[float] = []
        for r in range(args.rounds + 1):  # round 0 warms every case up and is not kept
            for name, case in cases.items():
                waited.append(wait_for_quiet())  # the case before it has finished its leftover work
                start = time.perf_counter()
                case.run_epochs(args.block)
                if r:
                    per_step[name].append((time.perf_counter() - start) * 1e6 / (args.block * args.batches))
            if r:
                print(f"round {r}/{args.rounds}: " + ", ".join(
                    f"{name} {statistics.fmean(v):.0f} us" for name, v in per_step.items()), file=sys.stderr, flush=True)
        info = {name: case.close() for name, case in cases.items()}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    lines = {}
    for name, values in per_step.items():
        lines[name] = {"case": name, "blocks": len(values), "step_mean_us": round(statistics.fmean(values), 1),
                       "step_median_us": round(statistics.median(values), 1), **info[name]}
        print(json.dumps(lines[name]), flush=True)
    plain = lines["plain"]
    summary: dict = {}
    for name, line in lines.items():
        if name != "plain":
            summary[f"ratio_{name}_mean"] = round(line["step_mean_us"] / plain["step_mean_us"], 3)
            summary[f"ratio_{name}_median"] = round(line["step_median_us"] / plain["step_median_us"], 3)
            per_block = [a / b for a, b in zip(per_step[name], per_step["plain"], strict=True)]
            summary[f"ratio_{name}_block_median"] = round(statistics.median(per_block), 3)
    summary["offloop_vs_offloaded_mean"] = round(lines["offloop"]["step_mean_us"] / lines["offloaded"]["step_mean_us"], 3)
    summary["offloop_vs_tb_wandb_mean"] = round(lines["offloop"]["step_mean_us"] / lines["tb_wandb"]["step_mean_us"], 3)
    summary["target"] = {"ratio_offloop_mean": TARGET, "met": summary["ratio_offloop_mean"] <= TARGET}
    summary |= {"rounds": args.rounds, "epochs_per_block": args.block,
                "quiet_wait_s_median": round(statistics.median(waited), 2), "quiet_wait_s_max": round(max(waited), 2),
                "batches_per_epoch": args.batches, "eval_batches": EVAL_BATCHES,
                "torch": torch.__version__, "threads": torch.get_num_threads()}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
