"""offloop: training-loop callbacks that run off the loop.

The one import line a user writes: `from offloop import Trainer, Callback, Event, State,
Logger, Time, Timestamp` (and `log_metrics`, for training code that logs scalars). Built-in callbacks are in `offloop.callbacks`, log destinations
in `offloop.loggers`, the bus itself in `offloop.bus`. Names resolve lazily (PEP 562), so
a read-only command (`offloop ls`, `attach`, `halt`) never imports torch.

Dependencies flow one way: `offloop.trainer` and `offloop.workers` import `offloop.bus`;
`offloop.bus` imports neither, and neither imports the other. The `offloop` command line
(`offloop.cli`, `offloop.commands`) is the one place that sees all three.
"""

from __future__ import annotations

import importlib
from typing import Any

#: public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "Trainer": "offloop.trainer",
    "Callback": "offloop.workers",
    "Event": "offloop.bus",
    "State": "offloop.workers",
    "Logger": "offloop.workers",
    "Time": "offloop.bus",
    "TimeUnit": "offloop.bus",
    "Timestamp": "offloop.bus",
    "log_metrics": "offloop.trainer",
    "ComposerModel": "offloop.models",
    "ComposerClassifier": "offloop.models",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'offloop' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
