"""`ProgressBarCallback`: a progress bar per training and evaluation epoch, tqdm's or a plain one.

Promise: offloop does not need tqdm; without it the bar is Composer's ProgressBar's line
(`progress_line`), redrawn in place on a terminal.
"""

from __future__ import annotations

from typing import Any, TextIO

from offloop.workers.callbacks.accelerated.adapter import TrainerCallback
from offloop.workers.callbacks.progress_line import TextBar

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
        return TextBar(total, desc, file)
    return tqdm(total=total, desc=desc, file=file)

