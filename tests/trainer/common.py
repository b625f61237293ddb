"""Small models and data shared by the trainer tests (no downloads, fixed seeds)."""

from __future__ import annotations

import threading

from torch.utils.data import Dataset

from offloop.bus import ControlClient


class GatedDataset(Dataset):
    """Blocks the `gate_at`-th item fetch until `release` is set: a deterministic point
    in training at which a test can line up control requests."""

    def __init__(self, base: Dataset, gate_at: int) -> None:
        self.base, self.gate_at, self.fetches = base, gate_at, 0
        self.reached, self.release = threading.Event(), threading.Event()

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index):
        self.fetches += 1
        if self.fetches == self.gate_at:
            self.reached.set()
            if not self.release.wait(timeout=30):
                raise TimeoutError("gate never released")
        return self.base[index]


def ask(endpoint: str, op: str, args: dict, out: dict, key: str | None = None) -> threading.Thread:
    """Send a control request from another thread (request() waits for its ack); the ack
    lands in out[key or op]."""

    def run():
        with ControlClient(endpoint) as client:
            out[key or op] = client.request(op, args, timeout=30)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread
