"""`FileLogger`: Composer's file logger, every metric, hyperparameter and text line in a file."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from offloop.workers.destinations.base import (
    LoggerDestination,
    check_flush_interval,
    format_value,
    jsonable,
)

__all__ = ["FileLogger"]


class FileLogger(LoggerDestination):
    """Composer's FileLogger: every metric, hyperparameter and text line in a file, as text
    (`[metric][batch=N]: name: value`) or, for a name ending in `.jsonl`, one JSON object a
    line. `{run_name}` and `{rank}` in `filename` are filled in when the run is known."""

    def __init__(self, filename: str | Path = "{run_name}/logs-rank{rank}.txt",
                 flush_interval: int = 100,
                 log_format: str | None = None) -> None:
        self.filename = str(filename)
        try:
            self.filename.format(run_name="run", rank=0)
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"FileLogger: filename {self.filename!r} is not a valid format "
                             f"string ({exc!r}); "
                             "its fields are {run_name} and {rank}") from None
        self.log_format = log_format or ("jsonl" if self.filename.endswith(".jsonl") else "text")
        if self.log_format not in ("text", "jsonl"):
            raise ValueError("FileLogger: log_format must be 'text' or 'jsonl', "
                             f"got {log_format!r}")
        check_flush_interval("FileLogger", flush_interval)
        self.flush_interval = flush_interval
        self.run_name, self.rank = "run", 0
        self._file = None
        self._lines = 0

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_file": None}

    def init(self, state, logger) -> None:
        self.run_name, self.rank = state.run_name or self.run_name, state.rank

    @property
    def path(self) -> Path:
        return Path(self.filename.format(run_name=self.run_name, rank=self.rank))

    def _write(self, record: dict[str, Any], text: str) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a")
        self._file.write((json.dumps(record) if self.log_format == "jsonl" else text) + "\n")
        self._lines += 1
        if self._lines % self.flush_interval == 0:
            self._file.flush()

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        values = jsonable(metrics)
        if self.log_format == "jsonl":
            self._write({"step": step, "time": time.time(), **values}, "")
        else:
            for name, value in values.items():
                self._write({}, f"[metric][batch={step}]: {name}: {format_value(value)}")

    def log_hyperparameters(self, hparams: dict[str, Any]) -> None:
        values = jsonable(hparams)
        if self.log_format == "jsonl":
            self._write({"hparams": values, "time": time.time()}, "")
        else:
            for name, value in values.items():
                self._write({}, f"[hyperparameter]: {name}: {value}")

    def log_text(self, text: str) -> None:
        self._write({"text": text, "time": time.time()}, f"[text]: {text}")

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        file, self._file = self._file, None  # a call after close() opens the file again
        if file is not None:
            file.close()
