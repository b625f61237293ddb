"""Callbacks and logger destinations the logger tests send to worker processes, in a
module of their own: a worker rebuilds them by importing this module alone (defined in a
test module, they would bring its imports along: MLflow's, wandb's, TensorBoard's)."""

from __future__ import annotations

import json
import os
import time

import torch

from offloop.loggers import LoggerDestination
from offloop.workers import Callback


class Stalls(LoggerDestination):
    """A tracking server that stops answering: each call waits until `gate` exists (60 s at
    most), then writes down its step."""

    def __init__(self, gate, out) -> None:
        self.gate, self.out = str(gate), str(out)

    def log_metrics(self, metrics, step) -> None:
        deadline = time.monotonic() + 60
        while not os.path.exists(self.gate) and time.monotonic() < deadline:
            time.sleep(0.005)
        with open(self.out, "a") as out:
            out.write(json.dumps({"step": step, "names": sorted(metrics)}) + "\n")


class OwnProcessLogs(Callback):
    """A callback in a process of its own: its logs stay there (the loggers are in the shared one)."""

    def batch_end(self, state, logger) -> None:
        logger.log_metrics({"elsewhere": 1.0})


class LogsImages(Callback):
    def fit_end(self, state, logger) -> None:
        logger.log_images(torch.rand(2, 3, 8, 8), name="samples")


class Breaks(LoggerDestination):
    def log_metrics(self, metrics, step) -> None:
        raise OSError("disk full")
