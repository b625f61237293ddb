"""`TensorboardLogger`: Composer's TensorBoard destination, the one offloop has; `offloop worker
--tensorboard DIR` is the same class writing straight into DIR (`run_folder=False`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from offloop.workers.destinations.base import (
    LoggerDestination,
    check_flush_interval,
    jsonable,
    require_extra,
)
from offloop.workers.destinations.tensorboard_events import EventWriter

if TYPE_CHECKING:  # numpy is imported where images are made, not at a worker's start
    import numpy as np

__all__ = ["TensorboardLogger", "TensorBoardLogger"]


class TensorboardLogger(LoggerDestination):
    """Composer's TensorboardLogger: event files in `{log_dir}/{run_name}`
    (`./tensorboard_logs` by default), or straight in `log_dir` with `run_folder=False`; every
    number logged as a scalar at its step, the hyperparameters with `add_hparams`, flushed
    every `flush_interval` calls. Needs the `tensorboard` extra. The writer opens in the
    worker, when the run is known (`init`), so the logger travels to it unopened."""

    def __init__(self, log_dir: str | Path | None = None, flush_interval: int = 100,
                 rank_zero_only: bool = True, *, run_folder: bool = True) -> None:
        # looked up when the Trainer is built, so a missing extra fails before training
        require_extra("tensorboard", "TensorboardLogger", "tensorboard")
        check_flush_interval("TensorboardLogger", flush_interval)
        self.log_dir = str(log_dir) if log_dir is not None else "tensorboard_logs"
        self.flush_interval, self.rank_zero_only = flush_interval, rank_zero_only
        self.run_folder = run_folder
        self.run_name = ""
        self._writer = None
        self._calls = 0

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_writer": None}

    def init(self, state, logger) -> None:
        self.run_name = state.run_name or self.run_name

    def _directory(self) -> str:
        if self.run_folder and self.run_name:
            return str(Path(self.log_dir) / self.run_name)
        return self.log_dir

    @property
    def writer(self):
        if self._writer is None:
            self._writer = EventWriter(self._directory())
        return self._writer

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        for key, value in metrics.items():
            value = jsonable(value)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, step)
        self._calls += 1
        if self._calls % self.flush_interval == 0:
            self.writer.flush()

    def log_hyperparameters(self, hparams: dict[str, Any]) -> None:
        flat = {key: value if isinstance(value, (int, float, str, bool))
                else json.dumps(jsonable(value)) for key, value in hparams.items()}
        self.writer.add_hparams(flat)

    def log_images(self, images: list[np.ndarray], name: str, step: int) -> None:
        for index, image in enumerate(images):
            tag = name if len(images) == 1 else f"{name}/{index}"
            self.writer.add_image(tag, image, step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


#: Lightning's spelling, kept for code that imports it: the same class. (It was a subclass
#: writing straight into `log_dir`, flushing every call: `run_folder=False, flush_interval=1`.)
TensorBoardLogger = TensorboardLogger
