"""`LoggerDestination`, the contract every log destination keeps, and what destinations share:
values made JSON-safe, a flush interval checked, an optional library looked up."""

from __future__ import annotations

import importlib.util
import math
from typing import TYPE_CHECKING, Any

from offloop.workers.scalars import as_scalar

if TYPE_CHECKING:  # numpy is imported where images are made, not at a worker's start
    import numpy as np

__all__ = ["LoggerDestination", "MissingExtraError", "check_flush_interval", "format_value",
           "jsonable", "require_extra"]


class LoggerDestination:
    """One place logs go; override what you support. `init(state, logger)`, when defined, is
    called once the run is known (Composer's)."""

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


class MissingExtraError(ImportError):
    """A logger's library is not installed: the message names the extra that installs it."""


def require_extra(module: str, owner: str, extra: str) -> None:
    """Looked up, not imported: the logger imports it in its worker, where the run opens."""
    if importlib.util.find_spec(module) is None:
        raise MissingExtraError(f"{owner} needs {module}, which is not installed: "
                                f"pip install 'offloop[{extra}]'")


def check_flush_interval(owner: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}: flush_interval must be an int >= 1, got {value!r}")


def jsonable(value: Any) -> Any:
    """`value` as JSON can hold it: numbers plain (NaN and infinities as strings), containers
    walked, anything else as its str()."""
    value = as_scalar(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return str(value)


def format_value(value: Any) -> str:
    """A logged value as a line of text shows it: floats to 6 significant digits."""
    value = jsonable(value)
    return f"{value:.6g}" if isinstance(value, float) else str(value)
