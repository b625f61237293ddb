"""`Logger`: what callbacks call to log; it hands every call to the run's destinations.

Composer's split: callbacks decide what to log, destinations (workers/destinations/) decide
where. Every destination gets every call, in the order given.
"""

from __future__ import annotations

import sys
import traceback
from typing import TYPE_CHECKING, Any

from offloop.workers.deliveries import Deliveries

# the destinations' names, importable from here as before they had modules of their own
from offloop.workers.destinations import (
    ConsoleLogger,
    FileLogger,
    JSONLLogger,
    LoggerDestination,
    MissingExtraError,
    TensorBoardLogger,
    TensorboardLogger,
)
from offloop.workers.scalars import as_scalar

if TYPE_CHECKING:  # imported where images are made: a worker starts without numpy
    import numpy as np

__all__ = ["Logger", "as_hwc_images", "ConsoleLogger", "FileLogger", "JSONLLogger",
           "LoggerDestination", "MissingExtraError", "TensorBoardLogger", "TensorboardLogger"]


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
            images = [image.copy() for image in images]
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
    return {key: as_scalar(value) for key, value in metrics.items()}


def as_hwc_images(images: Any, channels_last: bool = False) -> list[np.ndarray]:
    """Images as HWC numpy arrays, one per image, whatever layout Composer accepts."""
    import numpy as np

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
