"""Replay a recording through callbacks, offline and at full speed.

Halt and checkpoint requests made during a replay are printed, not sent: there is
no trainer to receive them. The ack a callback gets back says so (`replayed: True`).
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

from offloop.bus import RunInfo
from offloop.bus.control import Ack
from offloop.bus.recording import read_recording
from offloop.workers.runtime import CallbackRuntime

__all__ = ["replay", "ReplayControl"]


class ReplayControl:
    """Stands in for the control channel during a replay: prints each request."""

    def __init__(self, state, stream=None) -> None:
        self.state, self.stream = state, stream
        self.requests: list[tuple[str, dict]] = []
        self._ids = itertools.count(1)

    def request(self, op: str, args: dict | None = None, **_: object) -> Ack:
        args = dict(args or {})
        self.requests.append((op, args))
        step = self.state.timestamp.batch
        print(f"[replay] {op} requested at batch {step} with {args} (not sent: this is a replay)",
              file=self.stream or sys.stdout, flush=True)
        return Ack("replay", next(self._ids), op, True, {"step": step, "path": None, "replayed": True}, None)

    def close(self) -> None:
        pass


def replay(path: str | Path, callbacks: list, destinations=None) -> CallbackRuntime:
    """Feed every recorded event to `callbacks`, in order; returns the runtime (for stats)."""
    header, records = read_recording(path)
    info = RunInfo(header.get("run", ""), header.get("run_name", ""), 0, header.get("started", 0.0), {})
    worker = CallbackRuntime(info, callbacks, destinations=destinations)
    control = ReplayControl(worker.state)
    for callback in callbacks:
        callback.attach_control(control)
    worker.writer.apply_config(header.get("config") or {})
    malformed = truncated = 0
    try:
        for item in records:
            if isinstance(item, tuple):
                kind, n = item
                if kind == "malformed":
                    malformed += n
                elif kind == "truncated":
                    truncated += n
                else:
                    worker.stats.gaps += n
                continue
            worker.dispatch(item)
    finally:
        worker.close()
    worker.replay_requests = control.requests
    worker.malformed = malformed  # records that could not be read, skipped
    worker.truncated = bool(truncated)  # the file ended inside a record: what came before was replayed
    return worker
