"""Run callbacks on real events: a real Trainer publishes, a real CallbackRuntime (in a thread of
the test process, over real sockets) runs the callbacks, and the test reads the result."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import torch
from helpers.data import dataset
from torch import nn
from torch.utils.data import DataLoader

from offloop.trainer import Trainer
from offloop.workers import CallbackRuntime
from offloop.workers.logger import JSONLLogger, LoggerDestination


def classifier(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


class Paced(nn.Module):
    """The harness's classifier, taking `seconds` per training step (a stand-in for compute)."""

    def __init__(self, seconds: float = 0.004):
        super().__init__()
        self.net, self.seconds = classifier(), seconds

    def forward(self, x):
        if self.training:
            time.sleep(self.seconds)
        return self.net(x)


class MemoryLog(LoggerDestination):
    """Keeps every log_metrics call: [(step, metrics)]."""

    def __init__(self) -> None:
        self.metrics: list[tuple[int, dict[str, Any]]] = []
        self.texts: list[str] = []

    def log_metrics(self, metrics, step):
        self.metrics.append((step, dict(metrics)))

    def log_text(self, text):
        self.texts.append(text)

    def values(self, key: str) -> list:
        return [m[key] for _, m in self.metrics if key in m]


def run_with_worker(callbacks: list, tmp_path: Path, *, max_duration: str = "3ep",
                    destinations: list | None = None, worker_kw: dict | None = None,
                    answer_late: bool = True, **trainer_kw) -> tuple[Trainer, CallbackRuntime]:
    """Train a small classifier while a CallbackRuntime runs `callbacks`; returns both after the
    worker has handled fit_end and closed its callbacks. With `answer_late`, the trainer answers
    the worker's requests that come after fit() returned while it waits for the worker, as
    close() does for its own workers; without, they wait for close(), after the worker is done
    (a trainer busy with something else after its fit)."""
    kw: dict[str, Any] = {
        "loss_fn": torch.nn.functional.cross_entropy,
        "eval_dataloader": DataLoader(dataset(32, seed=2), batch_size=16),
        "run_dir": tmp_path / "run",
        "seed": 3,
    }
    kw.update(trainer_kw)
    train = kw.pop("train_dataloader", None) or DataLoader(dataset(), batch_size=8, shuffle=True)
    trainer = Trainer(kw.pop("model", None) or classifier(), train, max_duration, **kw)
    worker = CallbackRuntime(str(tmp_path / "run"), callbacks,
                             destinations=[MemoryLog()] if destinations is None else destinations,
                             **{"heartbeat_timeout": 30, **(worker_kw or {})})
    worker.connect()
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(worker.run()), daemon=True)
    thread.start()
    try:
        trainer.fit()
    finally:
        # a worker lags on a busy machine: its requests may come after fit() returned
        deadline = time.monotonic() + 60
        while thread.is_alive() and time.monotonic() < deadline:
            if answer_late:
                trainer.services.control.answer_late(trainer.timestamp)
            thread.join(timeout=0.02)
        trainer.close()
    assert not thread.is_alive(), "worker did not finish after fit_end"
    assert codes == [0], f"worker exited with {codes}: {worker.exit_message}"
    return trainer, worker


__all__ = ["run_with_worker", "MemoryLog", "JSONLLogger", "Paced", "classifier", "dataset"]
