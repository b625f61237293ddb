"""A realistic job end to end, offloop against Lightning (issue 45): construct, fit and
close, the wall time a user waits, in the same script, the cases taking turns.

Each case trains the same model on the same synthetic data for 3 epochs (each followed by
an evaluation and a checkpoint), with its framework's usual callback set, at its defaults:

  offloop    offloop's Trainer: SpeedMonitor, LRMonitor, EarlyStopper on the eval accuracy,
             CheckpointSaver every epoch and a TensorboardLogger (in one worker process),
             accuracy computed by torchmetrics in the trainer
  lightning  Lightning: ThroughputMonitor, LearningRateMonitor, EarlyStopping on the eval
             accuracy, ModelCheckpoint every epoch and its TensorBoardLogger (the loss
             logged every step, written every 50), accuracy by torchmetrics
  hand       the hand-written loop with the same evaluation and a torch.save each epoch:
             the floor, no callback, no logging

Models (--model): `mlp`, the real-size MLP of trainer_overhead.py (784-512-512-10, batch
64; launch-bound on a GPU), and `transformer`, a transformer encoder classifier (d 512,
6 layers, 8 heads, batch 32, sequence 128 on a GPU; --small: d 128, 2 layers, sequence
32, for the CPU), compute-bound.

The figure is each case's total wall time (construction to close, the worker's start and
the last checkpoint's write included), its mean over the rounds with the median beside;
`end_to_end_over_lightning` is offloop's mean over Lightning's (target <= 1.0).

What it does not show: a job of hours (construction and close, a worker's start among
them, weigh more here than in a long run), more than one rank, a callback that costs
anything (integrations.py and trainer_overhead.py show those).

Run: python benchmarks/end_to_end.py [--model mlp|transformer] [--device cpu|cuda]
                                     [--rounds N] [--batches N] [--small]
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

import torch
import torch.nn.functional as F
import torchmetrics
from installed import cache_bytecode
from torch import nn

from offloop.callbacks import CheckpointSaver, EarlyStopper, LRMonitor, SpeedMonitor
from offloop.loggers import TensorboardLogger
from offloop.trainer import Trainer

SEED, EPOCHS, EVAL_BATCHES, CLASSES = 0, 3, 10, 10


class Classifier(nn.Module):
    """A transformer encoder over a sequence of token embeddings, mean-pooled."""

    def __init__(self, d: int, layers: int, heads: int) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, CLASSES)

    def forward(self, x):
        return self.head(self.encoder(x).mean(dim=1))


class Batches:
    """In-memory batches as a loader (a plain list would be taken by Lightning as a list of
    loaders)."""

    def __init__(self, items: list) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self):
        return iter(self.items)


def make(model: str, small: bool, device: torch.device, batches: int):
    """(a fresh model, train batches, eval batches), the same in every case."""
    torch.manual_seed(SEED)
    gen = torch.Generator().manual_seed(SEED)
    if model == "mlp":
        net = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                            nn.Linear(512, CLASSES))
        shape = (64, 784)
    else:
        d, layers, seq, batch = (128, 2, 32, 16) if small else (512, 6, 128, 32)
        net = Classifier(d, layers, 8)
        shape = (batch, seq, d)

    def batch_list(n: int) -> Batches:
        return Batches([(torch.randn(*shape, generator=gen).to(device),
                 torch.randint(0, CLASSES, (shape[0],), generator=gen).to(device)) for _ in range(n)])

    return net.to(device), batch_list(batches), batch_list(EVAL_BATCHES)


def run_offloop(args, device, workdir: str) -> float:
    began = time.perf_counter()
    net, train, evaluation = make(args.model, args.small, device, args.batches)
    trainer = Trainer(
        net, train, f"{EPOCHS}ep", optimizers=torch.optim.SGD(net.parameters(), lr=0.01),
        loss_fn=F.cross_entropy, eval_dataloader=evaluation,
        eval_metrics=torchmetrics.classification.MulticlassAccuracy(num_classes=CLASSES),
        callbacks=[SpeedMonitor(), LRMonitor(),
                   EarlyStopper("MulticlassAccuracy", "eval", patience=10_000),
                   CheckpointSaver(save_interval="1ep")],
        loggers=[TensorboardLogger(log_dir=os.path.join(workdir, "tb"))],
        run_dir=os.path.join(workdir, "run"), device=device, seed=SEED, progress_bar=False)
    trainer.fit()
    trainer.close()
    return time.perf_counter() - began


def run_lightning(args, device, workdir: str) -> float:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import (
        EarlyStopping,
        LearningRateMonitor,
        ModelCheckpoint,
        ThroughputMonitor,
    )
    from lightning.pytorch.loggers import TensorBoardLogger

    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)

    class Module(pl.LightningModule):
        def __init__(self, net: nn.Module) -> None:
            super().__init__()
            self.net = net
            self.accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=CLASSES)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            out = self.net(x)
            self.accuracy.update(out, y)
            self.log("val_loss", F.cross_entropy(out, y))
            self.log("val_acc", self.accuracy)

        def configure_optimizers(self):
            return torch.optim.SGD(self.net.parameters(), lr=0.01)

    began = time.perf_counter()
    net, train, evaluation = make(args.model, args.small, device, args.batches)
    trainer = pl.Trainer(
        accelerator="gpu" if device.type == "cuda" else "cpu", devices=1, max_epochs=EPOCHS,
        callbacks=[ThroughputMonitor(batch_size_fn=lambda batch: batch[0].size(0)),
                   LearningRateMonitor(), EarlyStopping("val_acc", mode="max", patience=10_000),
                   ModelCheckpoint(dirpath=os.path.join(workdir, "checkpoints"), every_n_epochs=1)],
        logger=TensorBoardLogger(os.path.join(workdir, "tb")), enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(Module(net), train, evaluation)
    return time.perf_counter() - began


def run_hand(args, device, workdir: str) -> float:
    began = time.perf_counter()
    net, train, evaluation = make(args.model, args.small, device, args.batches)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=CLASSES).to(device)
    for epoch in range(EPOCHS):
        net.train()
        for x, y in train:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(net(x), y).backward()
            opt.step()
        net.eval()
        with torch.no_grad():
            for x, y in evaluation:
                accuracy.update(net(x), y)
        accuracy.compute().item()
        accuracy.reset()
        torch.save({"model": net.state_dict(), "optimizer": opt.state_dict()},
                   os.path.join(workdir, f"ep{epoch}.pt"))
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - began


CASES = {"hand": run_hand, "offloop": run_offloop, "lightning": run_lightning}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mlp", choices=("mlp", "transformer"))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=0, help="per epoch (default 300 mlp, 40 transformer)")
    parser.add_argument("--small", action="store_true", help="the transformer's CPU size")
    args = parser.parse_args()
    args.batches = args.batches or (300 if args.model == "mlp" else 40)
    device = torch.device(args.device)
    warnings.filterwarnings("ignore")
    cache_bytecode()  # a worker imports offloop as installed, not compiling it (installed.py)
    if device.type == "cpu":
        torch.set_num_threads(1)
    root = tempfile.mkdtemp(prefix="offloop-end-to-end-")
    walls: dict[str, list[float]] = {name: [] for name in CASES}
    try:
        run_hand(args, device, root)  # warm-up: first-use costs of torch (and the GPU) paid once
        for r in range(args.rounds):
            order = list(CASES) if r % 2 == 0 else list(reversed(CASES))
            for name in order:
                workdir = os.path.join(root, f"{name}-{r}")
                os.makedirs(workdir)
                walls[name].append(CASES[name](args, device, workdir))
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                f"{n} {w[-1]:.2f} s" for n, w in walls.items()), file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    mean, median = statistics.fmean, statistics.median
    result = {f"{name}_s_mean": round(mean(w), 2) for name, w in walls.items()}
    result |= {f"{name}_s_median": round(median(w), 2) for name, w in walls.items()}
    result |= {f"{name}_s": [round(x, 2) for x in w] for name, w in walls.items()}
    result["end_to_end_over_lightning"] = round(mean(walls["offloop"]) / mean(walls["lightning"]), 3)
    result["end_to_end_over_lightning_median"] = round(
        median(walls["offloop"]) / median(walls["lightning"]), 3)
    result["offloop_over_hand"] = round(mean(walls["offloop"]) / mean(walls["hand"]), 3)
    result["lightning_over_hand"] = round(mean(walls["lightning"]) / mean(walls["hand"]), 3)
    result |= {"target": {"end_to_end_over_lightning": 1.0,
                          "met": result["end_to_end_over_lightning"] <= 1.0},
               "model": args.model + ("-small" if args.small else ""), "device": str(device),
               "batches_per_epoch": args.batches, "epochs": EPOCHS, "rounds": args.rounds,
               "torch": torch.__version__}
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
