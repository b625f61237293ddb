"""A training job whose callback hangs at batch 3; it prints its worker's pid, then trains
slowly until it is killed. argv: run_dir."""

import json
import sys
import time

import torch
from helpers.fault_callbacks import Stuck
from torch import nn

from offloop.trainer import Trainer


class Slow(torch.utils.data.Dataset):
    def __len__(self):
        return 8000

    def __getitem__(self, i):
        if i % 8 == 0:
            time.sleep(0.05)
        return torch.ones(8), 0


trainer = Trainer(nn.Linear(8, 2), torch.utils.data.DataLoader(Slow(), batch_size=8), "1000ba",
                  loss_fn=nn.functional.cross_entropy, run_dir=sys.argv[1], heartbeat_interval=0.2,
                  callbacks=[Stuck()])
print(json.dumps({"worker": trainer.workers.workers[0].process.pid}), flush=True)
trainer.fit()
