"""A training job that holds at one batch until it is sent SIGTERM.

argv: run_dir, batches, hold (the number of batches trained before it holds), and
optionally a mode: "no-checkpoint" (checkpoint_on_sigterm=False) or "in-eval" (it holds
in the first evaluation after batch `hold` instead, past that batch's control poll).
Prints {"run_dir"} once the trainer is listening and {"holding": hold} when it holds;
after SIGTERM the Trainer checkpoints (unless told not to), publishes fit_end and exits
with status 143.
"""

import json
import sys
import time

import torch
from torch import nn

from offloop.trainer import Trainer


class Held(torch.utils.data.Dataset):
    """8 items per batch; fetching batch `hold`+1 waits (60 s at most) for the trainer's SIGTERM."""

    def __init__(self, batches: int, hold: int | None = None) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(batches * 8, 8, generator=gen)
        self.hold, self.trainer = hold, None

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        if self.hold is not None and i == self.hold * 8 and self.trainer is not None:
            print(json.dumps({"holding": self.hold}), flush=True)
            deadline = time.monotonic() + 60
            while not self.trainer.controller.sigterm and time.monotonic() < deadline:
                time.sleep(0.01)
        return self.x[i], int(self.x[i, 0] > 0)


def make(batches: int, hold: int | None, **kw) -> tuple[Trainer, Held]:
    torch.manual_seed(0)
    dataset = Held(batches, hold)
    loader = torch.utils.data.DataLoader(dataset, batch_size=8)
    trainer = Trainer(nn.Linear(8, 2), loader, f"{batches}ba", loss_fn=nn.functional.cross_entropy,
                      seed=3, **kw)
    dataset.trainer = trainer
    return trainer, dataset


if __name__ == "__main__":
    run_dir, batches, hold = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    mode = sys.argv[4] if len(sys.argv) > 4 else ""
    kw = {"run_dir": run_dir, "heartbeat_interval": 0.2}
    if mode == "no-checkpoint":
        kw["checkpoint_on_sigterm"] = False
    if mode == "in-eval":
        evaluation = Held(1, hold=0)  # its first item holds
        kw.update(eval_dataloader=torch.utils.data.DataLoader(evaluation, batch_size=8),
                  eval_interval=f"{hold}ba")
    trainer, _ = make(batches, None if mode == "in-eval" else hold, **kw)
    if mode == "in-eval":
        evaluation.trainer = trainer
    print(json.dumps({"run_dir": run_dir}), flush=True)
    trainer.fit()  # SIGTERM: raises SystemExit(143) after checkpoint, fit_end and close
    trainer.close()
    print(json.dumps({"done": trainer.timestamp.batch}), flush=True)
