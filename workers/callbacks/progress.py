"""`ProgressBar`: Composer's console progress bars, drawn by a worker, never by the loop.

One bar a training epoch and one an evaluation, as Composer's ProgressBarLogger draws
them: `train Epoch 0:  50%|████████████▌            | 4/8 [00:01<00:01, 3.9ba/s, loss/train/total=0.6931]`.
The Trainer adds it to the shared worker when `progress_bar=True` (the default) and its
stderr is a terminal; a finished bar stays as a line, the next one starts below it.

It writes whole updates straight to the terminal (file descriptor 2, one write each,
at most every `refresh` seconds and at each bar's end), carriage return first, so a bar
redraws in place; each line comes from `progress_line.render`.
"""

from __future__ import annotations

import os
import time
from typing import Any

from offloop.workers.callback import Callback
from offloop.workers.callbacks.progress_line import render

__all__ = ["ProgressBar", "render"]


class ProgressBar(Callback):
    def __init__(self, refresh: float = 0.1, fd: int = 2) -> None:
        self.refresh, self.fd = refresh, fd
        self._bar: dict[str, Any] | None = None
        self._held: dict[str, Any] | None = None  # an epoch's bar while an evaluation draws its own
        self._drawn = 0.0

    # ------------------------------------------------------------ events

    def epoch_start(self, state, logger) -> None:
        self._start(f"train Epoch {int(state.timestamp.epoch):3d}", state.dataloader_len)

    def batch_end(self, state, logger) -> None:
        loss = state.loss
        postfix = f"loss/train/total={loss:.4f}" if isinstance(loss, (int, float)) else ""
        self._update(int(state.timestamp.batch_in_epoch), postfix)

    def epoch_end(self, state, logger) -> None:
        self._finish()

    def eval_start(self, state, logger) -> None:
        self._held = self._bar  # an evaluation within an epoch: its bar below, then the epoch's again
        self._finish()
        label = state.dataloader_label or "eval"
        total = (state.config.get("eval_dataloaders") or {}).get(label)
        self._start(f"{label:<5} Batch {int(state.timestamp.batch):4d}", total)

    def eval_batch_end(self, state, logger) -> None:
        if self._bar is not None:
            self._update(self._bar["n"] + 1, "")

    def eval_end(self, state, logger) -> None:
        metrics = state.eval_metrics.get(state.dataloader_label or "eval", {})
        shown = ", ".join(f"{name}={value:.4f}" for name, value in metrics.items()
                          if isinstance(value, (int, float)) and not isinstance(value, bool))
        if self._bar is not None:
            self._update(self._bar["n"], shown, force=True)
        self._finish()
        held, self._held = self._held, None
        if held is not None and held["n"] < (held["total"] or 0):
            self._bar = held  # the epoch goes on: its bar again

    def fit_end(self, state, logger) -> None:
        self._finish()

    # ------------------------------------------------------------ drawing

    def _start(self, title: str, total: int | None) -> None:
        self._finish()
        self._bar = {"title": title, "total": total if isinstance(total, int) and total > 0 else None,
                     "n": 0, "started": time.monotonic(), "postfix": ""}
        self._update(0, "", force=True)

    def _update(self, n: int, postfix: str, force: bool = False) -> None:
        bar = self._bar
        if bar is None:
            return
        bar["n"] = n
        if postfix:
            bar["postfix"] = postfix
        now = time.monotonic()
        if force or now - self._drawn >= self.refresh or (bar["total"] and n >= bar["total"]):
            self._write("\r" + render(bar, now))
            self._drawn = now

    def _finish(self) -> None:
        if self._bar is not None:
            self._write("\r" + render(self._bar, time.monotonic()) + "\n")
            self._bar = None

    def _write(self, text: str) -> None:
        try:
            os.write(self.fd, text.encode())
        except OSError:  # the terminal is gone: no bars, training goes on
            self.fd = -1

    def __getstate__(self) -> dict[str, Any]:
        return {"refresh": self.refresh, "fd": self.fd, "_bar": None, "_held": None, "_drawn": 0.0}

