"""`Logger`: where callbacks' metrics go — console, a JSONL file, TensorBoard.

Composer's split: callbacks decide what to log, destinations decide where. Every
destination gets every call, in the order given.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, TextIO

__all__ = ["Logger", "LoggerDestination", "ConsoleLogger", "JSONLLogger", "TensorBoardLogger"]


class LoggerDestination:
    """One place logs go; override what you support."""

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        pass

    def log_hyperparameters(self, hparams: dict[str, Any]) -> None:
        pass

    def log_text(self, text: str) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.flush()


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return str(value)


class ConsoleLogger(LoggerDestination):
    def __init__(self, stream: TextIO | None = None, prefix: str = "") -> None:
        self.stream, self.prefix = stream, prefix

    def _out(self) -> TextIO:
        return self.stream or sys.stdout

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        parts = ", ".join(f"{k}: {_fmt(v)}" for k, v in metrics.items())
        print(f"{self.prefix}[step {step}] {parts}", file=self._out(), flush=True)

    def log_hyperparameters(self, hparams: dict[str, Any]) -> None:
        print(f"{self.prefix}hyperparameters: {json.dumps(_jsonable(hparams))}", file=self._out(), flush=True)

    def log_text(self, text: str) -> None:
        print(f"{self.prefix}{text}", file=self._out(), flush=True)


def _fmt(value: Any) -> str:
    value = _jsonable(value)
    return f"{value:.6g}" if isinstance(value, float) else str(value)


class JSONLLogger(LoggerDestination):
    """One JSON object per line: {"step", "time", **metrics}; hyperparameters as {"hparams"}."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", buffering=1)

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        self._file.write(json.dumps({"step": step, "time": time.time(), **_jsonable(metrics)}) + "\n")

    def log_hyperparameters(self, hparams: dict[str, Any]) -> None:
        self._file.write(json.dumps({"hparams": _jsonable(hparams), "time": time.time()}) + "\n")

    def flush(self) -> None:
        if not self._file.closed:
            self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


class TensorBoardLogger(LoggerDestination):
    """TensorBoard event files (needs the `tensorboard` extra)."""

    def __init__(self, log_dir: str | Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ImportError("TensorBoardLogger needs tensorboard: pip install 'offloop[tensorboard]'") from exc
        self._writer = SummaryWriter(str(log_dir))

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        for key, value in metrics.items():
            value = _jsonable(value)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(key, value, step)

    def log_hyperparameters(self, hparams: dict[str, Any]) -> None:
        self._writer.add_text("hparams", json.dumps(_jsonable(hparams)))

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class Logger:
    """What callbacks call: `logger.log_metrics({...})`; the step defaults to the batch."""

    def __init__(self, state, destinations: list[LoggerDestination] | None = None) -> None:
        self._state = state
        self.destinations = list(destinations if destinations is not None else [ConsoleLogger()])

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        step = self._state.timestamp.batch if step is None else step
        for dest in self.destinations:
            dest.log_metrics(dict(metrics), step)

    def log_hyperparameters(self, hparams: dict[str, Any]) -> None:
        for dest in self.destinations:
            dest.log_hyperparameters(dict(hparams))

    def log_text(self, text: str) -> None:
        for dest in self.destinations:
            dest.log_text(text)

    def flush(self) -> None:
        for dest in self.destinations:
            dest.flush()

    def close(self) -> None:
        for dest in self.destinations:
            dest.close()
