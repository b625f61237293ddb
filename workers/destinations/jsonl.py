"""`JSONLLogger`: one JSON object a line in a file (what `offloop worker --jsonl` writes)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from offloop.workers.destinations.base import LoggerDestination, jsonable

__all__ = ["JSONLLogger"]


class JSONLLogger(LoggerDestination):
    """One JSON object per line: {"step", "time", **metrics}; hyperparameters as {"hparams"}."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", buffering=1)

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        record = {"step": step, "time": time.time(), **jsonable(metrics)}
        self._file.write(json.dumps(record) + "\n")

    def log_hyperparameters(self, hparams: dict[str, Any]) -> None:
        self._file.write(json.dumps({"hparams": jsonable(hparams), "time": time.time()}) + "\n")

    def flush(self) -> None:
        if not self._file.closed:
            self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
