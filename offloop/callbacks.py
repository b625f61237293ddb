"""Every built-in callback, Composer's and pytorch-accelerated's: `from offloop.callbacks import EarlyStopper`.

The public home of `offloop.workers.callbacks`; names resolve lazily, so importing this
module loads only the callbacks a script names.
"""

from __future__ import annotations

from typing import Any

from offloop.workers import callbacks as _builtins

# pytorch-accelerated's callbacks raise it to stop training; it lives beside them here
__all__ = sorted([*_builtins.__all__, "StopTrainingError"])


def __getattr__(name: str) -> Any:
    if name == "StopTrainingError":
        from offloop.workers.callback import StopTrainingError

        return StopTrainingError
    return getattr(_builtins, name)


def __dir__() -> list[str]:
    return __all__
