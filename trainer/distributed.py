"""torch.distributed helpers: rank and world size, and the one CPU collective per batch
by which every rank agrees on control decisions (any rank may ask, gloo carries it)."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

from offloop.bus.discovery import at_host

__all__ = [
    "rank",
    "world_size",
    "is_distributed",
    "local_rank",
    "init_from_env",
    "ControlAgreement",
    "reachable",
]


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else int(os.environ.get("RANK", 0))


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def local_rank() -> int | None:
    """This rank's index on its node under torchrun (LOCAL_RANK), None when not launched so."""
    if int(os.environ.get("WORLD_SIZE", 1)) <= 1 or "LOCAL_RANK" not in os.environ:
        return None
    return int(os.environ["LOCAL_RANK"])


def init_from_env(device: torch.device) -> bool:
    """Join the process group torchrun describes: nccl when this rank trains on a GPU, gloo
    when on the CPU (a CPU run on a machine with GPUs too)."""
    if is_distributed() or int(os.environ.get("WORLD_SIZE", 1)) <= 1:
        return is_distributed()
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's communicator binds to the current device
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return True


def reachable(endpoint: str, master: str | None = None) -> str:
    """A rank's endpoint as the other nodes name it in run.json: one bound to every interface
    (0.0.0.0) is given the address this node reaches the rendezvous host (MASTER_ADDR)
    from, so a rank on another node is not listed at rank 0's host (or its hostname,
    when there is no such route)."""
    master = master or os.environ.get("MASTER_ADDR", "")
    try:
        with socket.socket(
            socket.AF_INET, socket.SOCK_DGRAM
        ) as probe:  # a route lookup; nothing is sent
            probe.connect((master, 9))
            address = probe.getsockname()[0]
    except OSError:
        address = socket.gethostname()
    return at_host(endpoint, address)


class ControlAgreement:
    """Agrees on (halt, checkpoints to save, rank 0's durable checkpoints) with one
    all-reduce (MAX) of a small CPU tensor.

    Rank 0 holds the control requests, but any rank may have reasons of its own (a
    SIGTERM delivered to that rank alone): whatever one rank asks for, every rank does,
    at the same batch. Every rank calls `agree()` at the same point of every batch, so
    no rank waits in a collective the others never enter. It runs on a gloo group even
    when training uses nccl, so it never touches a GPU stream.
    """

    def __init__(self) -> None:
        self.active = is_distributed() and dist.get_world_size() > 1
        if self.active:
            self._group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
            self._flags = torch.zeros(3, dtype=torch.int64)

    def agree(self, halt: bool, checkpoints: int, durable: int = 0) -> tuple[bool, int, int]:
        """(any rank halts, the most checkpoints any rank asks for, the highest `durable`):
        rank 0 passes how many of its checkpoints are answered, the others 0, so every rank
        learns when rank 0's files are on disk (it writes them in the background)."""
        if not self.active:
            return halt, checkpoints, durable
        self._flags[0], self._flags[1], self._flags[2] = int(halt), checkpoints, durable
        dist.all_reduce(self._flags, op=dist.ReduceOp.MAX, group=self._group)
        return bool(self._flags[0]), int(self._flags[1]), int(self._flags[2])

    def gather(self, obj):
        """Every rank's `obj`, on every rank (used only on checkpoint steps)."""
        if not self.active:
            return [obj]
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj, group=self._group)
        return out
