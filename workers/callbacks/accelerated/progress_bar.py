"""`ProgressBarCallback`: a progress bar per training and evaluation epoch, tqdm's or a plain one.

Promise: offloop does not need tqdm; without it the bar is text, redrawn in place on a terminal.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from offloop.workers.callbacks.accelerated.adapter import TrainerCallback

__all__ = ["ProgressBarCallback"]


class ProgressBarCallback(TrainerCallback):
    """A progress bar for each training and evaluation epoch: tqdm's when tqdm is installed,
    else a plain text bar (redrawn in place on a terminal, one line per epoch otherwise).
    `file` is where it is drawn (default: standard error)."""

    file: TextIO | None = None
    pbar = None
    eval_pbar = None

    def __init__(self, file: TextIO | None = None) -> None:
        self.file = file
        self.pbar = None
        self.eval_pbar = None

    def on_train_epoch_start(self, trainer, **kwargs):
        self._close("pbar")
        self.pbar = _progress_bar(trainer.state.dataloader_len,
                                  f"epoch {trainer.run_history.current_epoch}", self.file)

    def on_train_step_end(self, trainer, **kwargs):
        if self.pbar is None:  # joined mid-epoch
            self.on_train_epoch_start(trainer)
        self.pbar.update(max(trainer.state.timestamp.batch_in_epoch - self.pbar.n, 0))

    def on_train_epoch_end(self, trainer, **kwargs):
        self._close("pbar")

    def on_eval_epoch_start(self, trainer, dataloader_label=None, **kwargs):
        self._close("eval_pbar")
        label = dataloader_label or "eval"
        total = (trainer.state.config.get("eval_dataloaders") or {}).get(label)
        self.eval_pbar = _progress_bar(total, label, self.file)

    def on_eval_step_end(self, trainer, **kwargs):
        if self.eval_pbar is not None:
            self.eval_pbar.update(1)

    def on_eval_epoch_end(self, trainer, **kwargs):
        self._close("eval_pbar")

    def close(self, state, logger) -> None:
        self._close("pbar")
        self._close("eval_pbar")

    def _close(self, name: str) -> None:
        bar = getattr(self, name, None)
        if bar is not None:
            bar.close()
            setattr(self, name, None)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update(pbar=None, eval_pbar=None)
        return state


def _progress_bar(total: int | None, desc: str, file: TextIO | None):
    try:
        from tqdm import tqdm
    except ImportError:
        return _TextBar(total, desc, file)
    return tqdm(total=total, desc=desc, file=file)


class _TextBar:
    """The part of tqdm's interface ProgressBarCallback uses, for when tqdm is absent."""

    width = 30

    def __init__(self, total: int | None, desc: str, file: TextIO | None) -> None:
        self.total, self.desc, self.n = total, desc, 0
        self.file = file if file is not None else sys.stderr
        isatty = getattr(self.file, "isatty", None)
        self._live = bool(isatty and isatty())
        self._start = time.monotonic()
        self._closed = False

    def update(self, n: int = 1) -> None:
        self.n += n
        if self._live:
            self.file.write("\r" + self._line())
            self.file.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.file.write(("\r" if self._live else "") + self._line() + "\n")
        self.file.flush()

    def _line(self) -> str:
        elapsed = time.monotonic() - self._start
        if not self.total:
            return f"{self.desc}: {self.n} [{elapsed:.1f}s]"
        done = min(self.n / self.total, 1.0)
        bar = "#" * int(done * self.width)
        return f"{self.desc}: {done:4.0%}|{bar:<{self.width}}| {self.n}/{self.total} [{elapsed:.1f}s]"
