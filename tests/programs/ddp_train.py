"""A tiny deterministic DDP job, meant to be launched by torchrun (gloo, CPU, also on a machine
with GPUs; --device names another, as the Trainer's `device` does).

Each rank prints JSON lines: {"started": rank, "pid": ...} once its Trainer exists;
{"blocked": N, "rank": 0} when --block-at N holds rank 0 before it loads batch N
(0-based, counted over the whole run) until --wait-requests control requests are queued
for the trainer and the --gate-file (if given) exists; and, when fit() ends (also by
SIGTERM), one line with the rank, its final timestamp and a digest of its final weights.
"""

import argparse
import hashlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from offloop.trainer import Trainer, arguments, distributed

BATCH_SIZE = 4
SAMPLES = 64  # 32 per rank: 8 batches per epoch on each of 2 ranks


def say(**fields) -> None:
    # one write of a short line: the two ranks share torchrun's stdout, lines stay whole
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def weights_digest(state_dict) -> str:
    """sha256 over every tensor's bytes, in key order: equal only when bit-for-bit equal."""
    digest = hashlib.sha256()
    for key in sorted(state_dict):
        digest.update(key.encode())
        digest.update(state_dict[key].detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


class Data(Dataset):
    """Fixed random inputs and labels; rank 0 can be held at one fetch."""

    def __init__(self, gate_fetch: int = 0, gate=None) -> None:
        gen = torch.Generator().manual_seed(1)
        self.x = torch.randn(SAMPLES, 8, generator=gen)
        self.y = (self.x[:, 0] > 0).long() + (self.x[:, 1] > 0).long()
        self.fetches, self.gate_fetch, self.gate = 0, gate_fetch, gate

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index):
        self.fetches += 1
        if self.gate is not None and self.fetches == self.gate_fetch:
            self.gate()
        return self.x[index], self.y[index]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--max-duration", required=True)
    parser.add_argument("--load-path")
    parser.add_argument("--block-at", type=int, default=-1)
    parser.add_argument("--wait-requests", type=int, default=0)
    parser.add_argument("--gate-file")
    parser.add_argument("--gate-timeout", type=float, default=30.0)
    parser.add_argument("--host", default="127.0.0.1", help="the address this rank's sockets bind")
    parser.add_argument("--keys", help="CURVE keys folder (needed beyond loopback)")
    parser.add_argument("--device", default="cpu", help="the Trainer's device argument")
    args = parser.parse_args()

    # the sampler needs the process group; Trainer then reuses it (and resolves the same device)
    distributed.init_from_env(arguments.resolve_device(args.device, distributed.local_rank()))
    rank = distributed.rank()
    holder = {}

    def gate() -> None:
        """Rank 0 waits here (before loading batch --block-at) until the control server
        has queued the requests and the gate file exists, so that what the test does
        meanwhile takes effect after that batch, at one known step."""
        say(blocked=args.block_at, rank=rank)
        deadline = time.monotonic() + args.gate_timeout
        control = holder["trainer"].control
        # the server thread queues requests for the trainer's next poll(); read, not taken
        while (len(control.inbox) < args.wait_requests
               or (args.gate_file and not os.path.exists(args.gate_file))):
            if time.monotonic() > deadline:
                raise TimeoutError("the gate was never opened")
            time.sleep(0.002)

    gated = rank == 0 and args.block_at >= 0
    dataset = Data(args.block_at * BATCH_SIZE + 1, gate) if gated else Data()
    sampler = DistributedSampler(dataset, shuffle=True, seed=3)
    loader = DataLoader(dataset, batch_size=BATCH_SIZE, sampler=sampler)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)  # state to resume
    # a seed per rank: each rank's dropout draws differ, so a resume that gave a rank
    # another rank's RNG state would not match the uninterrupted run
    trainer = Trainer(model, loader, args.max_duration, loss_fn=nn.functional.cross_entropy,
                      optimizers=optimizer, seed=7 + rank, run_dir=args.run_dir, load_path=args.load_path,
                      heartbeat_interval=0.2, host=args.host, keys=args.keys, device=args.device)
    holder["trainer"] = trainer
    say(started=rank, pid=os.getpid(), world_size=trainer.world_size,
        resumed_at=trainer.timestamp.batch)
    try:
        trainer.fit()  # after a SIGTERM it closes the trainer and raises SystemExit
    finally:  # printed before close(): torchrun may stop this rank once another has exited
        exc = sys.exc_info()[1]
        ts = trainer.timestamp
        bare = trainer.model.module if hasattr(trainer.model, "module") else trainer.model
        say(rank=rank, final=True, epoch=ts.epoch, batch=ts.batch, batch_in_epoch=ts.batch_in_epoch,
            weights=weights_digest(bare.state_dict()), stopped_by=trainer.stopped_by,
            checkpoints=trainer.checkpoints, exit=None if exc is None else repr(exc))
    trainer.close()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
