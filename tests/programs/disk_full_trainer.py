"""A training job whose files may not grow beyond a few KiB (RLIMIT_FSIZE, SIGXFSZ ignored),
so writing a checkpoint fails with EFBIG, as on a full disk.

argv: run_dir, batches, fsize_limit_bytes. Prints {"run_dir"} once listening; fetching
batch 3 prints {"holding": 2} and waits (60 s at most) until a control request has
arrived; prints {"done", ...} last.
"""

import json
import os
import resource
import signal
import sys
import time

import torch
from torch import nn

from offloop.trainer import Trainer


class WaitsForARequest(torch.utils.data.Dataset):
    def __init__(self, batches: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(batches * 8, 8, generator=gen)
        self.trainer = None

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        if i == 2 * 8 and self.trainer is not None:
            print(json.dumps({"holding": 2}), flush=True)
            deadline = time.monotonic() + 60
            while self.trainer.control.stats.received < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
        return self.x[i], int(self.x[i, 0] > 0)


if __name__ == "__main__":
    run_dir, batches, limit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    dataset = WaitsForARequest(batches)
    model = nn.Sequential(nn.Linear(8, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 2))
    trainer = Trainer(model, torch.utils.data.DataLoader(dataset, batch_size=8), f"{batches}ba",
                      loss_fn=nn.functional.cross_entropy, run_dir=run_dir, heartbeat_interval=0.2)
    dataset.trainer = trainer
    print(json.dumps({"run_dir": run_dir}), flush=True)
    trainer.fit()
    folder = trainer.save_folder
    files = sorted(os.listdir(folder)) if folder.exists() else []
    trainer.close()
    print(json.dumps({"done": trainer.timestamp.batch, "checkpoints": trainer.checkpoints,
                      "files": files, "fsize_limit": limit}), flush=True)
