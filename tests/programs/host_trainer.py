"""A training job on a host of its own (tests/helpers/netns.py): bound to that host's
address, with CURVE keys. Batches come every --batch-seconds; it trains --batches batches
or until halted, once the --go file exists (60 s at most).

Prints {"pid", "run_name", "endpoints"} once its sockets are bound, and at the end
{"done": batches trained, "stopped_by", "batch_times": the wall time (time.time()) each
batch was taken from the loader, "drops": the publisher's}. With --exporter-port, a
PrometheusExporter in a worker the trainer starts serves /metrics on the host's address.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

from offloop.trainer import Trainer


class Paced:
    """A batch every `seconds`, `n` of them; notes when the loop took each one."""

    def __init__(self, n: int, seconds: float) -> None:
        self.n, self.seconds, self.taken = n, seconds, []

    def __iter__(self):
        gen = torch.Generator().manual_seed(0)
        for _ in range(self.n):
            time.sleep(self.seconds)
            self.taken.append(time.time())
            yield torch.randn(8, 8, generator=gen), torch.randint(0, 2, (8,), generator=gen)

    def __len__(self) -> int:
        return self.n


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--keys", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--go", required=True)
    parser.add_argument("--batches", type=int, required=True)
    parser.add_argument("--batch-seconds", type=float, default=0.02)
    parser.add_argument("--exporter-port", type=int)
    # the trainer's queue for each subscriber, in messages, and its burst interval: a queue a
    # partition overflows
    parser.add_argument("--subscriber-hwm", type=int)
    parser.add_argument("--burst-interval", type=float, default=0.005)
    args = parser.parse_args()

    out = os.fdopen(os.dup(1), "w")  # this script's JSON lines; the workers' prints go to stderr
    os.dup2(2, 1)
    callbacks = []
    if args.exporter_port:
        from offloop.callbacks import PrometheusExporter

        callbacks.append(PrometheusExporter(port=args.exporter_port, addr=args.host, targets_dir=None))
    if args.subscriber_hwm:
        from offloop.bus.publisher import Publisher

        Publisher.__init__.__kwdefaults__["subscriber_hwm"] = args.subscriber_hwm
    data = Paced(args.batches, args.batch_seconds)
    trainer = Trainer(nn.Linear(8, 2), data, f"{args.batches}ba", loss_fn=nn.functional.cross_entropy,
                      run_dir=args.run_dir, host=args.host, keys=args.keys, heartbeat_interval=0.2,
                      callbacks=callbacks, progress_bar=False, burst_interval=args.burst_interval)
    endpoints = {**trainer.publisher.endpoints, "control": trainer.control.endpoint}
    print(json.dumps({"pid": os.getpid(), "run_name": trainer.run_name, "endpoints": endpoints}),
          file=out, flush=True)
    deadline = time.monotonic() + 60
    while not Path(args.go).exists():
        if time.monotonic() > deadline:
            sys.exit("the go file never appeared")
        time.sleep(0.01)
    trainer.fit()
    drops = trainer.publisher.stats.drops
    trainer.close()
    print(json.dumps({"done": trainer.timestamp.batch, "stopped_by": trainer.stopped_by,
                      "batch_times": data.taken, "drops": drops}), file=out, flush=True)


if __name__ == "__main__":
    main()
