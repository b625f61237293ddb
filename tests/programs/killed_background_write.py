"""A Trainer whose background checkpoint write stops half-way, to be killed there.

argv: run_dir. Writes a first checkpoint whole (save_checkpoint(), which returns once it
is durable) and prints {"first": path}. Then a client asks for a checkpoint at batch 2;
the writer thread's serializer writes half of the file, fsyncs it and prints {"inside":
path of the bytes}, then hangs (60 s at most), as a SIGKILL or a power cut would find it.
(Taken at batch 1 or 2: whichever batch end first reads the request.) Meanwhile the
training thread trains on: once it has trained every batch it prints
{"trained": batches, "taken": the step the checkpoint holds, "acked": whether the client
had an ack}; then fit() waits for the write, and the test kills the process there.
"""

import io
import json
import sys
import threading
import time

import torch
from killed_mid_write import half_then_wait  # beside this program
from torch import nn

from offloop.bus import ControlClient
from offloop.trainer import Trainer, checkpoint

BATCHES = 40


def half_then_hang(obj, out, **kw) -> None:
    whole = io.BytesIO()
    real_save(obj, whole)
    half_then_wait(whole.getvalue(), out)  # prints {"inside": ...}, then hangs


class Paced(torch.utils.data.Dataset):
    """8 items a batch; loading batch 2 waits until the client's request has reached the trainer."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(BATCHES * 8, 8, generator=gen)
        self.trainer = None

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        if i == 8 and self.trainer is not None:
            deadline = time.monotonic() + 30
            while self.trainer.control.stats.received < 1 and time.monotonic() < deadline:
                time.sleep(0.005)
        return self.x[i], int(self.x[i, 0] > 0)


if __name__ == "__main__":
    torch.manual_seed(0)
    dataset = Paced()
    trainer = Trainer(nn.Linear(8, 2), torch.utils.data.DataLoader(dataset, batch_size=8),
                      f"{BATCHES}ba", loss_fn=nn.functional.cross_entropy, seed=3,
                      run_dir=sys.argv[1])
    dataset.trainer = trainer
    first = trainer.save_checkpoint(tag="first")
    print(json.dumps({"first": str(first)}), flush=True)
    real_save = torch.save
    checkpoint.torch.save = half_then_hang
    acks: dict = {}

    def ask() -> None:
        with ControlClient(trainer.control.endpoint) as client:
            acks["ack"] = client.request("checkpoint", {"tag": "second"}, timeout=60,
                                         on_taken=lambda result: acks.setdefault("taken", result))

    threading.Thread(target=ask, daemon=True).start()

    def report() -> None:
        while trainer.timestamp.batch < BATCHES:
            time.sleep(0.005)
        print(json.dumps({"trained": trainer.timestamp.batch,
                          "taken": acks.get("taken", {}).get("step"),
                          "acked": "ack" in acks}), flush=True)

    threading.Thread(target=report, daemon=True).start()
    trainer.fit()
    sys.exit(4)  # fit returned: it should have waited for the write, and been killed there
