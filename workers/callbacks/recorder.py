"""`Recorder`: writes every event it receives to a recording in the run directory.

The recording keeps each event's wire frames as they arrived (an event that came in a
burst is framed as a message of its own, its fields and tensor bytes unchanged) and
marks gaps where events were lost, so `offloop replay` can feed it to callbacks later, offline.
"""

from __future__ import annotations

import time
from pathlib import Path

from offloop.bus.recording import RecordingWriter
from offloop.bus.wire import event_frames
from offloop.workers.callback import Callback

__all__ = ["Recorder"]


class Recorder(Callback):
    """Record the run to `path` (default: <run_dir>/recording-<time>.offloop)."""

    records_messages = True  # the worker hands it raw messages and gaps

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        self._writer: RecordingWriter | None = None

    def run_event(self, event, state, logger) -> None:
        """Every event is recorded in record(); nothing to do per event here."""

    def start(self, info, config: dict) -> None:
        path = Path(self.path) if self.path else Path(info.run_dir or ".") / (
            f"recording-{time.strftime('%Y%m%d-%H%M%S')}.offloop")
        self.path = str(path)
        self._writer = RecordingWriter(path, info.run_id, info.run_name, dict(config))

    def record(self, msg) -> None:
        if self._writer is not None:
            self._writer.event(event_frames(msg))  # as it arrived, or framed alone if in a burst

    def record_gap(self, topic: str, n: int) -> None:
        if self._writer is not None:
            self._writer.gap(topic, n)

    def close(self, state, logger) -> None:
        if self._writer is not None:
            self._writer.close()
            logger.log_text(f"recorded {self._writer.events} events ({self._writer.gaps} lost) to {self.path}")
