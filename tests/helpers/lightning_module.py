"""A small Lightning module on generated data (no downloads), shared by the Lightning tests
and their torchrun-free DDP program (tests/programs/ddp_lightning.py)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from helpers.control_request import RequestFromHook
from helpers.data import dataset
from torch.utils.data import DataLoader

from offloop.integrations.lightning import OffloopCallback


def loader(n: int = 64, batch_size: int = 8) -> DataLoader:
    return DataLoader(dataset(n), batch_size=batch_size)


class Classifier(pl.LightningModule):
    """An MLP; `val_loss` is logged, or a constant when `flat_val` (a stopper's metric
    that never improves)."""

    def __init__(self, flat_val: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        self.flat_val = flat_val

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("val_loss", torch.tensor(1.0) if self.flat_val else loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def trainer(callbacks: list, **kwargs) -> pl.Trainer:
    """A quiet CPU Trainer: no progress bar, logger or checkpointing of Lightning's own."""
    settings = dict(accelerator="cpu", devices=1, max_epochs=2, enable_progress_bar=False, logger=False,
                    enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0)
    return pl.Trainer(callbacks=callbacks, **(settings | kwargs))


class AskAt(pl.Callback):
    """Sends a control request at `batch` (rank 0: it holds the control server), read at
    that batch's end; `ack()` is its answer."""

    def __init__(self, offloop: OffloopCallback, batch: int, op: str, args: dict) -> None:
        self.offloop, self.batch = offloop, batch
        self.request = RequestFromHook(op, args)
        self.ack = self.request.ack

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.batch and trainer.global_rank == 0:
            self.request.send(self.offloop.run)
