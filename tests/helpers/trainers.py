"""The tests' small model, its loader and the one trainer factory (no downloads, fixed
seeds): a 3-class classifier of `helpers.data.dataset()`, trained on the CPU."""

from __future__ import annotations

from pathlib import Path

import torch
from helpers.data import dataset as data
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 3))


def loader(n: int = 64, batch_size: int = 8, shuffle: bool = True, dataset=None) -> DataLoader:
    return DataLoader(dataset or data(n), batch_size=batch_size, shuffle=shuffle)


def small_trainer(tmp_path: Path, duration: str = "1ep", *, model: nn.Module | None = None,
                  name: str = "run", samples: int = 32, batch_size: int = 8,
                  shuffle: bool = False, **kw):
    """A Trainer of `model` (default `mlp()`) on `samples` points in batches of
    `batch_size`, cross-entropy, its run folder `tmp_path / name`; `kw` goes to Trainer."""
    from offloop.trainer import Trainer

    return Trainer(model if model is not None else mlp(), loader(samples, batch_size, shuffle),
                   duration, loss_fn=F.cross_entropy, run_dir=tmp_path / name, **kw)
