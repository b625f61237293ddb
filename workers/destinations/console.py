"""`ConsoleLogger`: metric lines and the callbacks' text on the worker's console."""

from __future__ import annotations

import json
import sys
from typing import Any, TextIO

from offloop.workers.destinations.base import LoggerDestination, format_value, jsonable

__all__ = ["ConsoleLogger"]


class ConsoleLogger(LoggerDestination):
    """Lines on the console: `stream` a file object, or 'stdout' / 'stderr' (Composer's
    console_stream; a name travels to a worker, an open stream does not).

    `metrics=False` prints the callbacks' text alone (progress lines, a stopper's reason, a
    checkpoint's path), as they would print in process, and no metric line per step: what
    a Trainer's worker prints when the run has no loggers and `log_to_console=False`."""

    def __init__(self, stream: TextIO | str | None = None, prefix: str = "",
                 metrics: bool = True) -> None:
        if isinstance(stream, str) and stream not in ("stdout", "stderr"):
            raise ValueError("ConsoleLogger: stream must be 'stdout', 'stderr' or a file object, "
                             f"got {stream!r}")
        self.stream, self.prefix, self.metrics = stream, prefix, metrics

    def _out(self) -> TextIO:
        if isinstance(self.stream, str):
            return sys.stderr if self.stream == "stderr" else sys.stdout
        return self.stream or sys.stdout

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        if not self.metrics:
            return
        parts = ", ".join(f"{k}: {format_value(v)}" for k, v in metrics.items())
        print(f"{self.prefix}[step {step}] {parts}", file=self._out(), flush=True)

    def log_hyperparameters(self, hparams: dict[str, Any]) -> None:
        if not self.metrics:
            return
        print(f"{self.prefix}hyperparameters: {json.dumps(jsonable(hparams))}", file=self._out(),
              flush=True)

    def log_text(self, text: str) -> None:
        print(f"{self.prefix}{text}", file=self._out(), flush=True)
