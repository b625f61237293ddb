"""`LogMetricsCallback`: the run history's latest metrics, to the worker's logger and a JSONL file.

Promise: 'train' metrics at each training epoch's end, the others after each evaluation.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, TextIO

from offloop.workers.callbacks.accelerated.adapter import TrainerCallback

__all__ = ["LogMetricsCallback"]


class LogMetricsCallback(TrainerCallback):
    """Logs the latest value of every metric in the run history: 'train'-prefixed ones at the
    end of a training epoch, the others after each evaluation.

    By default through the worker's logger (the console unless the worker was given other
    destinations), and, given `jsonl_path`, to a JSONL file with one line per logged step:
    {"step", "epoch", "time", **metrics}, the train and eval metrics of an epoch's end on
    one line. Subclass and override `log_metrics(trainer, metrics)` to log elsewhere.
    """

    jsonl_path: str | os.PathLike | None = None
    # made on first use: a subclass need not call this __init__
    _pending: dict[int, dict[str, Any]] | None = None  # step -> its JSONL line, until it is whole
    _jsonl: TextIO | None = None

    def __init__(self, jsonl_path: str | os.PathLike | None = None) -> None:
        if jsonl_path is not None and not isinstance(jsonl_path, (str, os.PathLike)):
            raise TypeError(f"jsonl_path must be a path, got {jsonl_path!r}")
        self.jsonl_path = jsonl_path

    def on_train_step_end(self, trainer, **kwargs):
        self._write_lines(before=trainer.state.timestamp.batch)  # the last step's line is whole

    def on_train_epoch_end(self, trainer, **kwargs):
        names = [n for n in sorted(trainer.run_history.get_metric_names()) if n.startswith("train")]
        self._log_latest_metrics(trainer, names)

    def on_eval_epoch_end(self, trainer, **kwargs):
        names = [n for n in sorted(trainer.run_history.get_metric_names()) if not n.startswith("train")]
        self._log_latest_metrics(trainer, names)

    def on_training_run_end(self, trainer, **kwargs):
        self._write_lines()

    def close(self, state, logger) -> None:
        self._write_lines()
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_jsonl", None)  # an open file stays with the process that opened it
        return state

    def _log_latest_metrics(self, trainer, metric_names: list[str]) -> None:
        if metric_names:
            history = trainer.run_history
            self.log_metrics(trainer, {name: history.get_latest_metric(name) for name in metric_names})

    def log_metrics(self, trainer, metrics: dict) -> None:
        """Where the metrics go: the worker's logger, and the JSONL file when configured."""
        step = trainer.state.timestamp.batch
        if trainer.logger is not None:
            trainer.logger.log_metrics(metrics, step=step)
        else:
            for name, value in metrics.items():
                trainer.print(f"{name}: {value}")
        if self.jsonl_path is not None:
            if self._pending is None:
                self._pending = {}
            line = self._pending.setdefault(step, {"step": step, "epoch": trainer.run_history.current_epoch,
                                                   "time": time.time()})
            line.update({name: _json_value(value) for name, value in metrics.items()})

    def _write_lines(self, before: int | None = None) -> None:
        if not self._pending:
            return
        due = sorted(step for step in self._pending if before is None or step < before)
        if not due:
            return
        if self._jsonl is None:
            path = Path(self.jsonl_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._jsonl = path.open("a", buffering=1)
        for step in due:
            self._jsonl.write(json.dumps(self._pending.pop(step)) + "\n")


def _json_value(value: Any) -> Any:
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    return value if isinstance(value, (int, float, str, bool)) or value is None else str(value)
