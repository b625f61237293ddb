"""The program a Trainer starts for its callbacks: `main(conn, settings)`, called by the
trainer's bootstrap (`offloop.trainer.supervisor.WORKER_BOOTSTRAP`, run as `python -c`) once
it has read the settings and put the trainer's sys.path in place.

Promise: the user's main module is never imported again. The callbacks arrive by value
(cloudpickled, as loky, Dask and Ray send them) over a private socket pair inherited from
the trainer that started this process, so callbacks defined in a script without a
`__main__` guard, in `python -`/`python -c` code or in a notebook cell work, and the
user's code runs once. A callback that cannot be rebuilt here is reported to the trainer
in one line before training starts.

On the socket pair (`multiprocessing.connection` framing, nothing else can reach it):
trainer -> here: the settings (a pickled dict of plain values: `sys_path`, `run_dir`,
`keys`, `heartbeat_timeout`, `nice`, `count`), then each callback, cloudpickled on its own;
here -> trainer: ("ready", None), ("fit_end", stats), ("error", (index or None, message)):
the index of the callback the message is about, None for the process as a whole.
"""

from __future__ import annotations

import atexit
import gc
import io
import logging
import os
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import NoReturn

log = logging.getLogger("offloop.worker")
#: the file objects that hold written bytes in memory until flushed
_BUFFERED = (io.BufferedWriter, io.BufferedRandom, io.TextIOWrapper)
PIPE_BUF = 4096  # bytes a write() to a pipe puts in it at once, never interleaved (POSIX: 512 at least; Linux 4096)


def main(conn: Connection, settings: dict) -> None:
    """Rebuild the callbacks and serve them. The bootstrap has already put the trainer's
    import path first, so callbacks pickled by reference (a module beside the user's script,
    an installed package) are found where the trainer found them."""
    whole_lines()
    if settings["nice"]:
        lower_priority(settings["nice"])
    import cloudpickle

    callbacks = []
    for index in range(settings["count"]):
        try:
            callbacks.append(cloudpickle.loads(conn.recv_bytes()))
        except Exception as exc:  # its class cannot be rebuilt here: said in one line, no traceback
            conn.send(("error", (index, f"cannot be rebuilt in its worker process: {type(exc).__name__}: {exc}")))
            raise SystemExit(2) from None
    loggers = []
    for index in range(settings.get("loggers", 0)):
        try:
            loggers.append(cloudpickle.loads(conn.recv_bytes()))
        except Exception as exc:
            conn.send(("error", (None, f"logger {index + 1} cannot be rebuilt in its worker process: "
                                       f"{type(exc).__name__}: {exc}")))
            raise SystemExit(2) from None
    from offloop.workers.runtime import serve_trainer_callbacks

    try:
        serve_trainer_callbacks(callbacks, settings["run_dir"], conn, settings["keys"],
                                settings["heartbeat_timeout"], settings.get("index"), loggers,
                                settings.get("builtins"), settings["progress_every"])
    except SystemExit as end:  # served to the end: its callbacks and loggers are closed
        leave(end.code)


def leave(code: int | None) -> NoReturn:
    """End the worker without the interpreter's teardown, which, with torch imported,
    takes longer than everything else the worker does at the end, and `close()` waits for
    it (docs/benchmarks.md). What Python's exit does that anyone can see is done here, in
    its order: the threads that are not daemons are waited for, atexit's handlers run (a
    library's own, such as a tracker's final upload, and this process's line-buffered
    output), every file still open for writing is flushed, then the process ends."""
    if code is not None and not isinstance(code, int):  # as Python's exit: said, then 1
        print(code, file=sys.stderr)
    main_thread = threading.main_thread()
    for thread in threading.enumerate():
        if thread is not main_thread and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for obj in gc.get_objects():  # a file a callback left open: its buffer reaches the disk
        if issubclass(type(obj), _BUFFERED):  # not isinstance: it would run ABCs' hooks
            try:
                if not obj.closed and obj.writable():
                    obj.flush()
            except Exception:  # closed or broken meanwhile: nothing of it to save
                pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code if isinstance(code, int) else 0 if code is None else 1)


class WholeLines(io.RawIOBase):
    """A file descriptor written a whole line at a time: what a callback prints reaches a
    terminal or pipe shared with other processes (the trainer, other workers) without
    being cut or glued to their lines. Complete lines go out in one write() each (writes
    up to PIPE_BUF, 4 KiB, are atomic on a pipe); a line's unfinished tail waits for its
    newline, or for the end of the process."""

    def __init__(self, fd: int) -> None:
        self.fd, self._tail = fd, b""

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        data = bytes(data)
        text = self._tail + data
        cut = text.rfind(b"\n") + 1
        self._tail = text[cut:]
        chunk = b""
        for line in text[:cut].splitlines(keepends=True):  # as few writes as stay atomic
            if chunk and len(chunk) + len(line) > PIPE_BUF:
                self._write_all(chunk)
                chunk = b""
            chunk += line
        if chunk:
            self._write_all(chunk)
        return len(data)

    def flush(self) -> None:
        pass  # a partial line waits for its newline: written now, another line could follow it

    def close(self) -> None:
        if self._tail:
            self._write_all(self._tail)
            self._tail = b""
        super().close()

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]


def whole_lines() -> None:
    """stdout and stderr line by line where they are a pipe or a file (`| tee`, CI logs).
    A terminal keeps Python's own line buffering, so a progress bar redrawn with \r shows."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None or stream.isatty():
            continue
        raw = WholeLines(stream.fileno())
        wrapped = io.TextIOWrapper(io.BufferedWriter(raw, 1 << 16), encoding=stream.encoding,
                                   errors=stream.errors, line_buffering=True)
        setattr(sys, name, wrapped)
        atexit.register(wrapped.close)


def lower_priority(nice: int) -> None:
    """Add `nice` to this process's nice value: first to this thread, so every thread it
    starts later (ZeroMQ's, and any that importing the callbacks starts) inherits it, then
    to the threads it has already."""
    try:
        os.nice(nice)
        tasks = Path("/proc/self/task")
        if tasks.is_dir():  # Linux: a nice value belongs to each thread
            me = threading.get_native_id()
            for tid in (int(t.name) for t in tasks.iterdir() if t.name.isdigit()):
                if tid == me:
                    continue
                try:
                    os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
                except ProcessLookupError:
                    pass  # that thread has ended
    except OSError as exc:
        log.warning("offloop: callback worker keeps part of the trainer's CPU priority: %s", exc)
