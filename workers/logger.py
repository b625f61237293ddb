"""`Logger`: where callbacks' metrics go — console, a JSONL file, TensorBoard.

Composer's split: callbacks decide what to log, destinations decide where. Every
destination gets every call, in the order given.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
import time
import traceback
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from offloop.workers.deliveries import Deliveries

__all__ = ["MissingExtraError", "Logger", "LoggerDestination", "ConsoleLogger", "JSONLLogger", "TensorBoardLogger",
           "TensorboardLogger", "FileLogger"]


class LoggerDestination:
    """One place logs go; override what you support."""

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        pass

    def log_hyperparameters(self, hparams: dict[str, Any]) -> None:
        pass

    def log_text(self, text: str) -> None:
        pass

    def log_images(self, images: list[np.ndarray], name: str, step: int) -> None:
        """`images`: HWC arrays (uint8, or floats in [0, 1]), as `Logger.log_images` makes them."""

    def log_table(self, columns: list[str], rows: list[list[Any]], name: str, step: int) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.flush()


def _scalar(value: Any) -> Any:
    """A 0-d tensor or numpy number as a Python number; anything else as it is."""
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return value.item()
    return value


def _jsonable(value: Any) -> Any:
    value = _scalar(value)
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
    """Lines on the console: `stream` a file object, or 'stdout' / 'stderr' (Composer's
    console_stream; a name travels to a worker, an open stream does not).

    `metrics=False` prints the callbacks' text alone (progress lines, a stopper's reason, a
    checkpoint's path), as they would print in process, and no metric line per step: what
    a Trainer's worker prints when the run has no loggers and `log_to_console=False`."""

    def __init__(self, stream: TextIO | str | None = None, prefix: str = "", metrics: bool = True) -> None:
        if isinstance(stream, str) and stream not in ("stdout", "stderr"):
            raise ValueError(f"ConsoleLogger: stream must be 'stdout', 'stderr' or a file object, got {stream!r}")
        self.stream, self.prefix, self.metrics = stream, prefix, metrics

    def _out(self) -> TextIO:
        if isinstance(self.stream, str):
            return sys.stderr if self.stream == "stderr" else sys.stdout
        return self.stream or sys.stdout

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        if not self.metrics:
            return
        parts = ", ".join(f"{k}: {_fmt(v)}" for k, v in metrics.items())
        print(f"{self.prefix}[step {step}] {parts}", file=self._out(), flush=True)

    def log_hyperparameters(self, hparams: dict[str, Any]) -> None:
        if not self.metrics:
            return
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


class TensorboardLogger(LoggerDestination):
    """Composer's TensorboardLogger: event files in `{log_dir}/{run_name}`
    (`./tensorboard_logs` by default); every number logged as a scalar at its step, the
    hyperparameters with `add_hparams`. Needs the `tensorboard` extra. The writer opens in
    the worker, when the run is known (`init`), so the logger travels to it unopened."""

    def __init__(self, log_dir: str | Path | None = None, flush_interval: int = 100,
                 rank_zero_only: bool = True) -> None:
        _require("tensorboard", "TensorboardLogger", "tensorboard")  # fails when the Trainer is built
        _check_flush_interval("TensorboardLogger", flush_interval)
        self.log_dir = str(log_dir) if log_dir is not None else "tensorboard_logs"
        self.flush_interval, self.rank_zero_only = flush_interval, rank_zero_only
        self.run_name = ""
        self._writer = None
        self._calls = 0

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_writer": None}

    def init(self, state, logger) -> None:
        self.run_name = state.run_name or self.run_name

    def _directory(self) -> str:
        return str(Path(self.log_dir) / self.run_name) if self.run_name else self.log_dir

    @property
    def writer(self):
        if self._writer is None:
            self._writer = _summary_writer()(self._directory())
        return self._writer

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        for key, value in metrics.items():
            value = _jsonable(value)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, step)
        self._calls += 1
        if self._calls % self.flush_interval == 0:
            self.writer.flush()

    def log_hyperparameters(self, hparams: dict[str, Any]) -> None:
        flat = {key: value if isinstance(value, (int, float, str, bool)) else json.dumps(_jsonable(value))
                for key, value in hparams.items()}
        self.writer.add_hparams(flat, {}, run_name=".")  # beside the scalars, not a run of its own

    def log_images(self, images: list[np.ndarray], name: str, step: int) -> None:
        for index, image in enumerate(images):
            tag = name if len(images) == 1 else f"{name}/{index}"
            self.writer.add_image(tag, image, step, dataformats="HWC")

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


class TensorBoardLogger(TensorboardLogger):
    """TensorBoard event files straight in `log_dir` (what `offloop worker --tensorboard`
    writes); Composer's `TensorboardLogger` adds the run's name below its `log_dir`."""

    def __init__(self, log_dir: str | Path) -> None:
        super().__init__(log_dir, flush_interval=1)

    def _directory(self) -> str:
        return self.log_dir


def _check_flush_interval(owner: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}: flush_interval must be an int >= 1, got {value!r}")


def _summary_writer():
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter


class MissingExtraError(ImportError):
    """A logger's library is not installed: the message names the extra that installs it."""


def _require(module: str, owner: str, extra: str) -> None:
    """Looked up, not imported: the logger imports it in its worker, where the run opens."""
    if importlib.util.find_spec(module) is None:
        raise MissingExtraError(f"{owner} needs {module}, which is not installed: pip install 'offloop[{extra}]'")


class FileLogger(LoggerDestination):
    """Composer's FileLogger: every metric, hyperparameter and text line in a file, as text
    (`[metric][batch=N]: name: value`) or, for a name ending in `.jsonl`, one JSON object a
    line. `{run_name}` and `{rank}` in `filename` are filled in when the run is known."""

    def __init__(self, filename: str | Path = "{run_name}/logs-rank{rank}.txt", flush_interval: int = 100,
                 log_format: str | None = None) -> None:
        self.filename = str(filename)
        try:
            self.filename.format(run_name="run", rank=0)
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"FileLogger: filename {self.filename!r} is not a valid format string ({exc!r}); "
                             "its fields are {run_name} and {rank}") from None
        self.log_format = log_format or ("jsonl" if self.filename.endswith(".jsonl") else "text")
        if self.log_format not in ("text", "jsonl"):
            raise ValueError(f"FileLogger: log_format must be 'text' or 'jsonl', got {log_format!r}")
        _check_flush_interval("FileLogger", flush_interval)
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
        values = _jsonable(metrics)
        if self.log_format == "jsonl":
            self._write({"step": step, "time": time.time(), **values}, "")
        else:
            for name, value in values.items():
                self._write({}, f"[metric][batch={step}]: {name}: {_fmt(value)}")

    def log_hyperparameters(self, hparams: dict[str, Any]) -> None:
        values = _jsonable(hparams)
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
        if self._file is not None:
            self._file.close()
            self._file = None


class Logger:
    """What callbacks call: `logger.log_metrics({...})`; the step defaults to the batch.

    A destination that raises (a tracking server gone, a full disk) is reported once on
    stderr and left out from then on, counted in `failed`: the other destinations and the
    callbacks that log go on.

    With `coalesce=True` (what a worker uses) the metrics of one step, from every callback
    that logs them, reach each destination as one call when the worker has handled the
    event (`commit()`): one `run.log` a step for wandb, not one per callback. A name
    logged again at the same step, or anything else logged, first commits what is
    pending: every value arrives, and destinations see steps in order.

    With `background=True` (what a worker uses too) the destinations are called on a
    thread of their own (workers/deliveries.py), so a slow one never holds up the
    callbacks; values are read when logged, and `close()` waits until every call is made."""

    def __init__(self, state, destinations: list[LoggerDestination] | None = None,
                 coalesce: bool = False, background: bool = False) -> None:
        self._state = state
        self.destinations = list(destinations if destinations is not None else [ConsoleLogger()])
        #: destinations left out after raising, by class name: how many calls each missed
        self.failed: dict[str, int] = {}
        self._broken: set[int] = set()
        self._coalesce = coalesce
        self._pending: dict[int, dict[str, Any]] = {}
        self._deliveries = Deliveries(self._deliver) if background else None

    @property
    def dropped(self) -> int:
        """log_* calls dropped because too many waited for the destinations (background only)."""
        return self._deliveries.dropped if self._deliveries is not None else 0

    @property
    def queued(self) -> int:
        """Calls not yet made by the destinations (background only)."""
        return self._deliveries.queued if self._deliveries is not None else 0

    def after_delivered(self, then) -> None:
        """Call `then()` once every call so far has reached the destinations (at once,
        here, when not in the background; else on the delivering thread)."""
        self.commit()
        if self._deliveries is None:
            then()
        else:
            self._deliveries.after(then)

    def wait(self, timeout: float | None = None) -> bool:
        """Until every call so far has reached the destinations; False if `timeout` passed
        first. Only a background Logger ever waits."""
        self.commit()
        return self._deliveries.wait(timeout) if self._deliveries is not None else True

    def commit(self) -> None:
        """Send the metrics pending from coalesced log_metrics() calls, step by step."""
        if self._pending:
            pending, self._pending = self._pending, {}
            for step, metrics in pending.items():
                self._each("log_metrics", metrics, step)

    def _each(self, method: str, *args: Any) -> None:
        if self._pending and method != "log_metrics":
            self.commit()
        if self._deliveries is None:
            self._deliver(method, args)
        else:
            self._deliveries.put(method, args)

    def _deliver(self, method: str, args: tuple) -> None:
        for index, dest in enumerate(self.destinations):
            name = type(dest).__name__
            if index in self._broken:
                self.failed[name] = self.failed.get(name, 0) + 1
                continue
            call = getattr(dest, method, None)
            if call is None:  # init() is optional, as in Composer
                continue
            try:
                call(*args)
            except Exception as exc:
                self._broken.add(index)
                self.failed[name] = self.failed.get(name, 0) + 1
                print(f"offloop logger: {name}.{method} raised {exc!r}; {name} gets nothing more "
                      f"this run\n{traceback.format_exc()}", file=sys.stderr, flush=True)

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        step = self._state.timestamp.batch if step is None else step
        if self._coalesce:
            pending = self._pending.get(step)
            if pending is not None and not pending.keys().isdisjoint(metrics):
                self.commit()  # a name logged twice at one step: each value is kept, in order
                pending = None
            if pending is None:
                pending = self._pending[step] = {}
            pending.update(metrics if self._deliveries is None else _values_now(metrics))
        elif self._deliveries is None:
            self._each("log_metrics", dict(metrics), step)
        else:
            self._each("log_metrics", _values_now(metrics), step)

    def log_hyperparameters(self, hparams: dict[str, Any]) -> None:
        self._each("log_hyperparameters", dict(hparams))

    def log_text(self, text: str) -> None:
        self._each("log_text", text)

    def log_images(self, images: Any, name: str = "Images", channels_last: bool = False,
                   step: int | None = None) -> None:
        """Composer's `log_images`: a tensor or array of one image (CHW, HWC with
        `channels_last`, or HW) or a batch (NCHW / NHWC), or a list of them."""
        step = self._state.timestamp.batch if step is None else step
        images = as_hwc_images(images, channels_last)
        if self._deliveries is not None:  # made later: a caller may reuse its array meanwhile
            images = [np.array(image) for image in images]
        self._each("log_images", images, name, step)

    def log_table(self, columns: list[str], rows: list[list[Any]], name: str = "Table",
                  step: int | None = None) -> None:
        step = self._state.timestamp.batch if step is None else step
        if any(len(row) != len(columns) for row in rows):
            raise ValueError(f"log_table {name!r}: every row needs {len(columns)} values, one per column")
        self._each("log_table", list(columns), [list(row) for row in rows], name, step)

    def init(self, state) -> None:
        """Tell each destination the run (Composer's `LoggerDestination.init(state, logger)`)."""
        self._each("init", state, self)

    def flush(self) -> None:
        self._each("flush")

    def close(self) -> None:
        self._each("close")
        if self._deliveries is not None:
            self._deliveries.close()


def _values_now(metrics: dict[str, Any]) -> dict[str, Any]:
    """The metrics as they are now, for a destination called later: 0-d tensors and numpy
    numbers read at once (a callback may update a running tensor in place)."""
    return {key: _scalar(value) for key, value in metrics.items()}


def as_hwc_images(images: Any, channels_last: bool = False) -> list[np.ndarray]:
    """Images as HWC numpy arrays, one per image, whatever layout Composer accepts."""
    if isinstance(images, (list, tuple)):
        return [image for item in images for image in as_hwc_images(item, channels_last)]
    if hasattr(images, "detach"):
        images = images.detach().cpu().float().numpy()
    array = np.asarray(images)
    if array.ndim == 2:
        return [array[:, :, None]]
    if array.ndim == 3:
        return [array if channels_last else array.transpose(1, 2, 0)]
    if array.ndim == 4:
        return [image if channels_last else image.transpose(1, 2, 0) for image in array]
    raise ValueError(f"log_images: an image has 2 to 4 dimensions (HW, CHW, NCHW), got shape {array.shape}")
