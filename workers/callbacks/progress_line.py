"""The one progress-bar renderer: a bar as tqdm draws it, as a line of text.

Composer's `ProgressBar` and pytorch-accelerated's `ProgressBarCallback` (without tqdm) both
draw with `render()`; `TextBar` is the part of tqdm's interface the latter uses.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

__all__ = ["render", "TextBar"]

_WIDTH = 25
_BLOCKS = " ▏▎▍▌▋▊▉█"


def render(bar: dict[str, Any], now: float) -> str:
    """One line of a bar, as tqdm draws it: `bar` holds its title, total (or None), n,
    the monotonic time it started and a postfix."""
    n, total, elapsed = bar["n"], bar["total"], max(now - bar["started"], 1e-9)
    rate = n / elapsed
    extra = f", {bar['postfix']}" if bar["postfix"] else ""
    if total is None:
        return f"{bar['title']}: {n}ba [{_clock(elapsed)}, {rate:.2f}ba/s{extra}]"
    done = min(n / total, 1.0)
    eighths = int(done * _WIDTH * 8)
    full, part = divmod(eighths, 8)
    drawn = "█" * full + (_BLOCKS[part] if full < _WIDTH else "")
    remaining = (total - n) / rate if rate > 0 else 0.0
    return (f"{bar['title']}: {done * 100:3.0f}%|{drawn:<{_WIDTH}}| {n}/{total} "
            f"[{_clock(elapsed)}<{_clock(remaining)}, {rate:.2f}ba/s{extra}]")


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


class TextBar:
    """tqdm's `update(n)`, `n` and `close()`, drawn with `render()` on `file` (standard error by
    default): redrawn in place on a terminal, one line when closed otherwise."""

    def __init__(self, total: int | None, desc: str, file: TextIO | None) -> None:
        self.file = file if file is not None else sys.stderr
        self._bar = {"title": desc, "total": total or None, "n": 0, "started": time.monotonic(),
                     "postfix": ""}
        isatty = getattr(self.file, "isatty", None)
        self._live = bool(isatty and isatty())
        self._closed = False

    @property
    def n(self) -> int:
        return self._bar["n"]

    def update(self, n: int = 1) -> None:
        self._bar["n"] += n
        if self._live:
            self.file.write("\r" + render(self._bar, time.monotonic()))
            self.file.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.file.write(("\r" if self._live else "") + render(self._bar, time.monotonic()) + "\n")
        self.file.flush()
