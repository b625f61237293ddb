"""A training job with a PrometheusExporter listed for file discovery: argv = run_dir,
targets folder, stop file. It trains (20 ms a batch) until the stop file exists (60 s
at most), then closes, and prints its exporter's run name."""

import json
import os
import sys
import threading
import time
from pathlib import Path

import torch
from torch import nn

from offloop.callbacks import PrometheusExporter
from offloop.trainer import Trainer


class Paced:
    """Batches every 20 ms, endlessly (the run stops on a halt)."""

    def __iter__(self):
        gen = torch.Generator().manual_seed(0)
        while True:
            time.sleep(0.02)
            yield torch.randn(8, 8, generator=gen), torch.randint(0, 2, (8,), generator=gen)

    def __len__(self):
        return 1 << 30


if __name__ == "__main__":
    run_dir, targets, stop = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    out = os.fdopen(os.dup(1), "w")  # this script's JSON lines; the workers' prints go to stderr
    os.dup2(2, 1)
    trainer = Trainer(nn.Linear(8, 2), Paced(), "1000000ba", loss_fn=nn.functional.cross_entropy,
                      run_dir=run_dir, callbacks=[PrometheusExporter(port=0, targets_dir=targets)])

    def halt_on_stop_file():
        deadline = time.monotonic() + 60
        while not stop.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        trainer.request_halt("stop file")

    threading.Thread(target=halt_on_stop_file, daemon=True).start()
    print(json.dumps({"run_name": trainer.run_name, "pid": os.getpid()}), file=out, flush=True)
    trainer.fit()
    trainer.close()
    print(json.dumps({"done": trainer.timestamp.batch}), file=out, flush=True)
