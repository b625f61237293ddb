"""What a checkpoint costs the training loop (issue 45): the training thread's stall per
checkpoint against the floor of copying the same state to host memory, and against the
synchronous torch.save + fsync the loop paid before checkpoints were written off it.

A real Trainer trains an MLP of about 50M parameters (4096-wide, three hidden layers, Adam:
state about 576 MiB) on synthetic data; a client asks for a checkpoint over the control
channel every `--every` batches and waits for its ack (the file durable), as a
CheckpointSaver does. At the first batch boundary after each ack, on the training thread
(between steps, so each floor is measured beside the checkpoint it is compared with):

  copy_ms        copying every tensor of the same state (model and optimizer) into host
                 buffers allocated once, one copy_() each (on CUDA into pinned memory,
                 non-blocking, then one synchronize): the least a checkpoint can take from
                 the loop
  sync_save_ms   save_checkpoint() of the state as the loop wrote it before (torch.save of
                 the state_dicts, flush, fsync, rename, the folder fsynced), at the first
                 `--sync-saves` checkpoints

Per checkpoint, from the trainer (Control.stalls):

  stall_ms       the time the checkpoint held the training thread: waiting for the write
                 before it (none here: each is asked for after the last ack), the ranks'
                 collective, the state copied into the reused buffers, the write handed over

Beside them: write_ms (taken to the ack, which comes at the first batch end after the
file is durable), step_ms_quiet and step_ms_writing (the mean step with no write in
flight and with one: what the writer thread's CPU, memory traffic and GIL cost the loop
meanwhile, which the stall does not count), and loop_cost_ms: the stall plus that
slowing, per checkpoint, against sync_save_ms.

Its last line is one JSON object: stall_ms, copy_ms, sync_save_ms, stall_over_copy (means
over the checkpoints; target stall_over_copy <= 1.2 on the CPU) and the rest.

What it does not show: a model sharded over ranks, a slow or networked file system (the
write is off the loop, its length is not), the first checkpoint of a run (its buffers are
allocated then: reported apart, `first_stall_ms`).

Run: python benchmarks/checkpoint_stall.py [--device cpu|cuda] [--checkpoints N] [--every K]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from offloop.bus import ControlClient
from offloop.trainer import Trainer, checkpoint


def build(width: int, layers: int) -> nn.Module:
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks, nn.Linear(width, 10))


class Floors:
    """The floors, measured on the training thread between two steps when asked to."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path,
                 sync_saves: int) -> None:
        self.model, self.optimizer, self.folder = model, optimizer, folder
        self.sync_saves = sync_saves
        self.copy_ms: list[float] = []
        self.sync_save_ms: list[float] = []
        self.wanted = threading.Event()
        self._buffers: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def _tensors(self) -> list[torch.Tensor]:
        out = list(self.model.state_dict().values())
        for state in self.optimizer.state_dict()["state"].values():
            out += [v for v in state.values() if isinstance(v, torch.Tensor)]
        return out

    def measure(self) -> None:
        tensors = self._tensors()
        gpu = tensors[0].is_cuda
        if self._buffers is None:  # allocated once, as the product's HostCopy reuses its own
            self._buffers = [(torch.empty(t.shape, dtype=t.dtype, pin_memory=gpu), t) for t in tensors]
            for dst, src in self._buffers:
                dst.copy_(src)
        began = time.perf_counter()
        for dst, src in self._buffers:
            dst.copy_(src, non_blocking=gpu)
        if gpu:
            torch.cuda.synchronize()
        self.copy_ms.append((time.perf_counter() - began) * 1e3)
        if len(self.sync_save_ms) < self.sync_saves:
            path = self.folder / f"sync-{len(self.sync_save_ms)}.pt"
            began = time.perf_counter()
            checkpoint.save_checkpoint(path, {"model": self.model.state_dict(),
                                              "optimizers": [self.optimizer.state_dict()]})
            self.sync_save_ms.append((time.perf_counter() - began) * 1e3)
            path.unlink()


class TimedBatches:
    """The same synthetic batch every step; the time each is handed to the loop, and the
    floors measured between steps when they are wanted (that time left out of the steps)."""

    def __init__(self, steps: int, batch: int, width: int, device: torch.device) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(batch, width, generator=gen).to(device)
        self.y = torch.randint(0, 10, (batch,), generator=gen).to(device)
        self.steps = steps
        self.handed: list[float] = []
        self.left_out: list[tuple[int, float]] = []  # (step, seconds measuring floors before it)
        self.floors: Floors | None = None

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        for step in range(self.steps):
            floors = self.floors
            if floors is not None and floors.wanted.is_set():
                floors.wanted.clear()
                began = time.perf_counter()
                floors.measure()
                self.left_out.append((step, time.perf_counter() - began))
            self.handed.append(time.perf_counter())
            yield self.x, self.y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--checkpoints", type=int, default=6)
    parser.add_argument("--every", type=int, default=6, help="batches between checkpoints")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--sync-saves", type=int, default=3)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = build(args.width, args.layers).to(device)
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    warmup = 4
    steps = warmup + (args.checkpoints + 1) * args.every + 4
    batches = TimedBatches(steps, args.batch, args.width, device)
    with tempfile.TemporaryDirectory(prefix="offloop-ckpt-stall-") as tmp:
        trainer = Trainer(model, batches, f"{steps}ba", optimizers=optimizer,
                          loss_fn=F.cross_entropy, device=device, run_dir=Path(tmp) / "run",
                          seed=0, progress_bar=False)
        batches.floors = Floors(trainer.model, optimizer, Path(tmp), args.sync_saves)
        times: list[dict] = []

        def ask() -> None:
            with ControlClient(trainer.control.endpoint) as client:
                for n in range(args.checkpoints):
                    while trainer.timestamp.batch < warmup + n * args.every:
                        time.sleep(0.002)
                    entry: dict = {"sent": time.perf_counter()}
                    ack = client.request("checkpoint", {"tag": f"n{n}"}, timeout=120,
                                         on_taken=lambda r, e=entry: e.update(
                                             taken=time.perf_counter(), step=r["step"]))
                    entry["durable"] = time.perf_counter()
                    if not ack.ok:
                        raise SystemExit(f"checkpoint {n} refused: {ack.error}")
                    times.append(entry)
                    batches.floors.wanted.set()

        asker = threading.Thread(target=ask, daemon=True)
        asker.start()
        trainer.fit()
        asker.join(120)
        stalls_ms = [s * 1e3 for s in trainer.controller.stalls]
        state_mib = sum(Path(p).stat().st_size for p in trainer.checkpoints) / len(trainer.checkpoints) / 2**20
        trainer.close()
    floors = batches.floors
    if len(stalls_ms) != args.checkpoints or len(floors.copy_ms) < 2:
        raise SystemExit(f"{len(stalls_ms)} checkpoints taken, {len(floors.copy_ms)} floors: "
                         "train longer (--every)")
    # steps: the time between two batches handed over, less floors measured between them
    left_out = dict(batches.left_out)
    handed = batches.handed
    quiet, writing = [], []
    for step in range(warmup, len(handed) - 1):
        began, ended = handed[step], handed[step + 1]
        length = ended - began - left_out.get(step + 1, 0.0)
        during = any(e["taken"] < ended and began < e["durable"] for e in times)
        taking = any(began <= e["taken"] <= ended for e in times)
        if taking:
            continue  # the step that took a checkpoint: its cost is the stall
        (writing if during else quiet).append(length * 1e3)
    later = stalls_ms[1:]  # the first allocates the buffers
    mean = statistics.fmean
    result = {
        "device": str(device), "params": params, "state_mib": round(state_mib, 1),
        "checkpoints": len(later),
        "stall_ms": round(mean(later), 1), "stall_ms_median": round(statistics.median(later), 1),
        "first_stall_ms": round(stalls_ms[0], 1),
        "copy_ms": round(mean(floors.copy_ms), 1),
        "copy_ms_median": round(statistics.median(floors.copy_ms), 1),
        "sync_save_ms": round(mean(floors.sync_save_ms), 1),
        "stall_over_copy": round(mean(later) / mean(floors.copy_ms), 3),
        "sync_save_over_stall": round(mean(floors.sync_save_ms) / mean(later), 1),
        "write_ms": round(mean((e["durable"] - e["taken"]) * 1e3 for e in times), 1),
        # what a checkpoint cost the loop in all: its stall, and the steps slowed while it
        # was written (their excess over the quiet steps' mean), per checkpoint
        "loop_cost_ms": round(mean(later) + (
            (mean(writing) - mean(quiet)) * len(writing) / len(times) if writing and quiet else 0), 1),
        "step_ms_quiet": round(mean(quiet), 1) if quiet else None,
        "step_ms_writing": round(mean(writing), 1) if writing else None,
        "steps_quiet": len(quiet), "steps_writing": len(writing),
        "stalls_ms": [round(s, 1) for s in stalls_ms],
        "copies_ms": [round(c, 1) for c in floors.copy_ms],
    }
    print(json.dumps(result), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
