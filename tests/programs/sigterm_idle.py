"""A job that has finished fit() and is inside the publisher's send (holding its lock, as
release() does) when SIGTERM arrives: the Trainer must still close and exit 143, not
deadlock inside the signal handler. argv: run_dir."""

import os
import signal
import sys
import time

import torch
from torch import nn

from offloop.trainer import Trainer

x = torch.randn(16, 8)
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long()), batch_size=8)
trainer = Trainer(nn.Linear(8, 2), data, "1ep", loss_fn=nn.functional.cross_entropy, run_dir=sys.argv[1])
trainer.fit()
with trainer.publisher.outbox.lock:  # where release() is when the signal comes
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
print("not reached", flush=True)
