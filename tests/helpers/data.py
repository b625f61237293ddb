"""Generated data for the tests (no downloads, fixed seeds)."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset


def dataset(n: int = 64, seed: int = 1) -> TensorDataset:
    """`n` points of 8 features, each labelled 0, 1 or 2: how many of its first two are positive."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=gen)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())
