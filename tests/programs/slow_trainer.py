"""A real training job that takes a while: argv = run_dir, batches, seconds per batch,
optionally a file for a StepList callback, which then runs in a worker the trainer spawns,
and a file whose existence it waits for (20 s at most) before it trains. $SLOW_TRAINER_KEYS
names a keys folder for the run."""

import json
import os
import sys
import time

import torch
from torch import nn

from offloop.trainer import Trainer


class Slow(torch.utils.data.Dataset):
    def __init__(self, n, delay):
        gen = torch.Generator().manual_seed(0)
        self.x, self.delay = torch.randn(n, 8, generator=gen), delay

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if i % 8 == 0:
            time.sleep(self.delay)
        return self.x[i], int(self.x[i, 0] > 0)


if __name__ == "__main__":
    run_dir, batches, delay = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    loader = torch.utils.data.DataLoader(Slow(batches * 8, delay), batch_size=8)
    callbacks = []
    if len(sys.argv) > 4:
        from helpers.fault_callbacks import StepList

        callbacks.append(StepList(sys.argv[4]))
    trainer = Trainer(nn.Linear(8, 2), loader, f"{batches}ba", loss_fn=nn.functional.cross_entropy,
                      run_dir=run_dir, heartbeat_interval=0.2, callbacks=callbacks,
                      keys=os.environ.get("SLOW_TRAINER_KEYS"))
    print(json.dumps({"run_dir": run_dir, "pid": os.getpid()}), flush=True)
    if len(sys.argv) > 5:
        deadline = time.monotonic() + 20
        while not os.path.exists(sys.argv[5]) and time.monotonic() < deadline:
            time.sleep(0.01)
    trainer.fit()
    trainer.close()
    print(json.dumps({"done": trainer.timestamp.batch}), flush=True)
