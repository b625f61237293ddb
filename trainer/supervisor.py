"""Worker processes for a Trainer's `callbacks=[...]`: spawned, awaited, supervised.

The callbacks share one worker process and run there in order, as Composer runs them;
one that asks (`callback.in_own_process()`) gets a process of its own, or shares a named
one. Each process is a program of its own (`offloop.workers.spawned`, started through
`WORKER_BOOTSTRAP`), which never imports the user's main module, so a
script without a `__main__` guard, code piped to `python -`, `python -c` and notebooks all
work. Callbacks travel by value (cloudpickle) over a private socket pair, never over a
socket another process can reach. The trainer waits until every worker is listening
before it publishes `init` and raises if one cannot start; it never waits on a worker while
training, reports a worker that dies, and at the end gives each one until the run's last
`fit_end` has reached it before it closes the stream (a Trainer may fit() several times: a
worker lives through all of them, and a death between or during later fits is reported
and restarted like one in the first).

The worker program is found by module name: `trainer` never imports `workers` (the design
brief keeps them independent). It is found on the trainer's own `sys.path`, in its order:
`python -m` would put the working directory first, and a folder holding an `offloop/` of
its own (a clone's root, an image's WORKDIR) would shadow the installed package.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

import cloudpickle

from offloop.bus import Time, TimeUnit
from offloop.bus.security import ClientKeys
from offloop.trainer.decisions import decision_schedule
from offloop.trainer.errors import ConfigError

__all__ = ["CallbackWorkers", "WORKER_BOOTSTRAP", "WORKER_PROGRAM", "import_path", "process_groups"]

WORKER_PROGRAM = "offloop.workers.spawned"
#: The worker's `python -c` program, stdlib only until the path is the trainer's: `-c` puts the
#: working directory first on sys.path, so it goes before the first import, and the settings
#: (the trainer's sys.path first) are read before anything of offloop's or the user's loads.
WORKER_BOOTSTRAP = f"""\
import sys
if sys.path[:1] == [""]:
    del sys.path[0]
import os, pickle
from multiprocessing.connection import Connection
fd = int(sys.argv[1])
os.set_inheritable(fd, False)  # a process the callbacks start must not hold the trainer's pipe
conn = Connection(fd)
settings = pickle.loads(conn.recv_bytes())
sys.path[:] = settings["sys_path"] + [p for p in sys.path if p not in settings["sys_path"]]
from {WORKER_PROGRAM} import main
main(conn, settings)
"""
_SERVE_EVERY = 0.05  # seconds: a boundary wait also serves requests this often without a wake-up
#: seconds between the supervising thread's looks at its workers when none has written
SUPERVISE_EVERY = 0.5
#: seconds between a worker's progress reports (how far it is: `behind()`), sent to it at start
PROGRESS_EVERY = 1.0
#: seconds fit() waits at most for the worker drawing the progress bars to draw the last one
PROGRESS_WAIT = 5.0

log = logging.getLogger("offloop.trainer")


def process_groups(callbacks: list) -> list[list]:
    """The callbacks as their worker processes will run them: every callback without a
    `process_group` in one process, in the order given (as Composer runs them), first; then
    one process per group name, in the order the names first appear."""
    groups: dict[str | None, list] = {None: []}
    for callback in callbacks:
        groups.setdefault(getattr(callback, "process_group", None), []).append(callback)
    return [group for group in groups.values() if group]


def import_path() -> list[str]:
    """This process's sys.path as a child started elsewhere must see it: the working
    directory's entry ("", from `python -`, `-c` or a notebook) made absolute."""
    cwd = os.getcwd()
    return [entry or cwd for entry in sys.path]


def _serialized(callback: Any, what: str = "callback") -> bytes:
    """The callback (or logger) as its worker process rebuilds it (by value); ConfigError if
    it cannot be."""
    try:
        return cloudpickle.dumps(callback)
    except Exception as exc:
        raise ConfigError(f"{what} {type(callback).__name__} cannot be sent to its worker process: "
                          f"{type(exc).__name__}: {exc}") from None


class _Process:
    """A worker program's process, with the few calls the supervisor makes."""

    def __init__(self, popen: subprocess.Popen) -> None:
        self.popen, self.pid = popen, popen.pid

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        self.popen.terminate()


class _WorkerProcess:
    """The trainer's side of one worker process: its callbacks, its pipe, what it last
    reported. (The runtime inside that process is `offloop.workers.runtime.Worker`.)"""

    def __init__(self, callbacks: list, payloads: list[bytes], process, conn,
                 loggers: list[bytes]) -> None:
        self.callbacks, self.payloads, self.process, self.conn = callbacks, payloads, process, conn
        self.loggers = loggers  # the run's loggers, serialized: the shared worker holds them
        self.names = [type(callback).__name__ for callback in callbacks]
        self.name = "+".join(self.names + (["loggers"] if loggers else []))
        self.ready = False
        self.fits_seen = 0  # the number of the last fit whose fit_end it has handled
        self.fits_delivered = 0  # ... and whose loggers' calls up to it are all made
        self.logs = 0  # its loggers' calls not made yet, as it last reported
        self.reported_dead = False
        self.gone = False  # its exit has been handled (reported, restarted, or a clean end)
        self.restarts = 0
        self.report: dict = {}
        self.error = ""  # what the worker said when it could not start
        self.error_of: str = self.name  # the callback it was about (or all of them)
        self.batch = 0  # the last batch it had handled, as it last reported (about once a second)
        self.answered = 0  # the id of the last awaited event it has answered (AWAITS)
        self.pace: float | None = None  # batches a second between its last two reports
        self._reported_at: float | None = None

    def note_progress(self, batch: int, now: float) -> None:
        if self._reported_at is not None and now > self._reported_at:
            self.pace = max(0.0, (batch - self.batch) / (now - self._reported_at))
        self.batch, self._reported_at = batch, now

    def behind(self, batch: int, fits: int) -> str:
        """How far behind the trainer's `batch` (and `fits`-th fit_end) it is, and for how
        long at its pace; or, its callbacks done, that its loggers are still at work."""
        if self.fits_seen >= fits:
            return (f"past fit_end, its loggers still making calls ({self.logs} queued at its "
                    "last report: a destination slower than training)")
        late = max(0, batch - self.batch)
        if not self.pace:
            return f"at batch {self.batch} of {batch} ({late} behind; its pace is not known yet)"
        return (f"at batch {self.batch} of {batch} ({late} behind: about {late / self.pace:.0f}s "
                f"at its pace of {self.pace:.1f} batches/s)")


class CallbackWorkers:
    """One process per group of callbacks; see the module docstring."""

    def __init__(self, callbacks: list, run_dir: str, ready_timeout: float = 120.0,
                 keys: ClientKeys | None = None, max_restarts: int = 3,
                 heartbeat_timeout: float = 10.0, nice: int = 10, loggers: list | None = None,
                 builtins: dict[str, dict] | None = None) -> None:
        self.callbacks = list(callbacks)
        # serialized once, here: a callback that cannot travel fails the Trainer before its
        # sockets exist, and a restarted worker gets the callbacks as they were sent first
        self._groups = [(group, [_serialized(callback) for callback in group])
                        for group in process_groups(self.callbacks)]
        #: the run's loggers, for the shared worker (one is started for them if no callback
        #: shares it)
        self._loggers = [_serialized(destination, "logger") for destination in loggers or []]
        #: {class name: arguments} the shared worker builds besides its callbacks (the
        #: Trainer's save_*, progress_bar and log_to_console, as Composer's): the trainer
        #: names them and imports no callback
        self._builtins = dict(builtins or {})
        if (self._loggers or self._builtins) and (
                not self._groups or getattr(self._groups[0][0][0], "process_group", None)):
            self._groups.insert(0, ([], []))
        #: where each worker's callbacks decide (Callback.decides_on), checked now
        self.decision_schedule = decision_schedule([group for group, _ in self._groups])
        saver = self._builtins.get("CheckpointSaver")
        if saver is not None:  # it decides at its interval, as a CheckpointSaver one builds does
            every = Time.parse(saver["save_interval"])
            topic = "epoch_checkpoint" if every.unit is TimeUnit.EPOCH else "batch_checkpoint"
            self.decision_schedule.setdefault(topic, []).append((0, every))
        #: added to each worker's nice value: on a CPU it shares with the training loop, the
        #: loop comes first (a worker catches up in the gaps; its queue is bounded and counted)
        self.nice = nice
        #: a worker whose trainer sends no heartbeat for this long closes its callbacks and exits
        self.heartbeat_timeout = heartbeat_timeout
        # when the run has keys: the workers' own pair, admitted in memory for the run
        self.keys = keys
        # per worker; a restarted worker joins from the late-join state
        self.max_restarts = max_restarts
        self.restarts = 0
        self._stopping = False
        #: fit_end events the trainer has published; a worker's exit is its end (not a
        #: crash) only once the trainer closes the stream and the worker has handled them all
        self.fits = 0
        self.closing = False
        self.run_dir = run_dir
        self.ready_timeout = ready_timeout
        self.workers: list[_WorkerProcess] = []
        self.crashes: list[str] = []
        #: logger calls lost with workers ended behind them (each as it last reported its queue)
        self.logs_lost = 0
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # an answer came, or wake() was called
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start every worker and return once each is listening. Raises ConfigError, naming
        the callback and the cause, if one cannot start: before `init`, not a run without it."""
        if not self._groups:
            return
        for index, (group, payloads) in enumerate(self._groups):
            loggers = self._loggers if index == 0 else []
            self.workers.append(self._spawn(group, payloads, index, loggers))
        deadline = time.monotonic() + self.ready_timeout
        while not all(w.ready or w.gone for w in self.workers):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._receive(timeout=min(left, 0.5))
        for worker in self.workers:
            if not worker.ready:
                cause = worker.error or (
                    f"its process exited with code {worker.process.exitcode}" if worker.gone
                    else f"it did not listen within {self.ready_timeout:g}s")
                raise ConfigError(f"callback {worker.error_of} could not be started in its worker "
                                  f"process: {cause}")
        self._thread = threading.Thread(target=self._supervise, daemon=True,
                                        name="offloop-supervisor")
        self._thread.start()

    def _spawn(self, callbacks: list, payloads: list[bytes], index: int,
               loggers: list[bytes]) -> _WorkerProcess:
        ours, theirs = socket.socketpair()
        try:
            popen = subprocess.Popen([sys.executable, "-c", WORKER_BOOTSTRAP, str(theirs.fileno())],
                                     pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        conn = Connection(ours.detach())
        settings = {"sys_path": import_path(), "run_dir": self.run_dir, "keys": self.keys,
                    "heartbeat_timeout": self.heartbeat_timeout, "nice": self.nice,
                    "progress_every": PROGRESS_EVERY,
                    "count": len(payloads), "index": index, "loggers": len(loggers),
                    "builtins": self._builtins if index == 0 else {}}
        conn.send_bytes(pickle.dumps(settings))
        for payload in payloads + loggers:
            conn.send_bytes(payload)
        return _WorkerProcess(callbacks, payloads, _Process(popen), conn, loggers)

    def _restart(self, worker: _WorkerProcess) -> None:
        """Start a fresh process for a worker that died; it carries on from the late-join state."""
        if self._stopping or worker.restarts >= self.max_restarts:
            return
        fresh = self._spawn(worker.callbacks, worker.payloads, self.workers.index(worker),
                            worker.loggers)
        fresh.restarts = worker.restarts + 1
        with self._lock:
            self.workers[self.workers.index(worker)] = fresh
            self.restarts += 1
        log.warning("offloop: restarted callback worker %s (pid %s, restart %d of %d)",
                    fresh.name, fresh.process.pid, fresh.restarts, self.max_restarts)

    def _receive(self, timeout: float) -> None:
        # every worker whose exit is not handled yet: its end of the socket pair closes when
        # its process ends (however it ends), so no death goes unseen
        conns = [w.conn for w in self.workers if not w.gone]
        for ready in wait(conns, timeout=timeout):
            for worker in list(self.workers):
                if ready is worker.conn and not self._message(worker):
                    self._ended(worker)

    def _ended(self, worker: _WorkerProcess) -> None:
        """Its socket pair closed: the process is ending; wait for it, then judge the end."""
        worker.process.join(timeout=30)
        worker.gone = True
        if self.closing and worker.fits_seen >= self.fits or self._stopping:
            return  # its end, or stop() ended it: not a crash
        if not worker.ready and self._thread is None:
            return  # start() raises it
        self._dead(worker, f"exited with code {worker.process.exitcode}"
                   + (f" ({worker.error})" if worker.error else ""))
        if worker.ready:
            self._restart(worker)

    def _message(self, worker: _WorkerProcess) -> bool:
        """Handle one message; False once the worker's end is closed."""
        try:
            kind, payload = worker.conn.recv()
        except (EOFError, OSError):
            worker.conn.close()
            return False
        with self._lock:
            if kind == "ready":
                worker.ready = True
            elif kind == "fit_end":
                worker.fits_seen = max(worker.fits_seen, int(payload.get("fit") or 1))
                worker.report = payload
                worker.logs = int(payload.get("logs") or 0)
            elif kind == "answer":
                worker.answered = max(worker.answered, int(payload))
                self._changed.notify_all()
            elif kind == "delivered":
                worker.fits_delivered = max(worker.fits_delivered, int(payload.get("fit") or 1))
            elif kind == "progress":
                worker.note_progress(int(payload.get("batch") or 0), time.monotonic())
                worker.logs = int(payload.get("logs") or 0)
            elif kind == "error":
                index, worker.error = payload
                worker.error_of = worker.names[index] if index is not None else worker.name
                if worker.ready:  # before that, start() raises it
                    log.warning("offloop: worker %s: %s", worker.name, worker.error)
        return True

    def _dead(self, worker: _WorkerProcess, why: str) -> None:
        with self._lock:
            if worker.reported_dead:
                return
            worker.reported_dead = True
            message = (f"callback worker {worker.name} (pid {worker.process.pid}) {why}; "
                       "training goes on")
            self.crashes.append(message)
        log.warning("offloop: %s", message)

    def _supervise(self) -> None:
        while not self._stop.is_set():
            if all(w.gone for w in self.workers):
                return
            self._receive(timeout=SUPERVISE_EVERY)

    def fit_ended(self) -> int:
        """A fit_end is about to be published: its number (1 for the first fit)."""
        self.fits += 1
        return self.fits

    def begin_closing(self) -> None:
        """The run is closing: from here a worker that has handled every fit_end and exits
        has ended, not crashed."""
        self.closing = True

    def wait_answers(self, indexes: list[int], ident: int, timeout: float,
                     serve: Callable[[], None]) -> list[int]:
        """Wait until each worker of `indexes` has answered the awaited event `ident` (or
        is gone), calling `serve` first and after every wake-up (an answer, or `wake()`):
        the trainer answers the workers' requests meanwhile. Returns the workers that had
        not answered within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        serve()
        with self._changed:
            while True:
                waiting = [i for i in indexes
                           if i < len(self.workers) and self.workers[i].answered < ident
                           and not self.workers[i].gone and self.workers[i].process.is_alive()]
                left = deadline - time.monotonic()
                if not waiting or left <= 0:
                    return waiting
                self._changed.wait(min(left, _SERVE_EVERY))
                # serving publishes and may write a checkpoint: not under the lock
                self._lock.release()
                try:
                    serve()
                finally:
                    self._lock.acquire()

    def wake(self) -> None:
        """Wake a wait_answers() now: a control request has arrived (any thread)."""
        with self._changed:
            self._changed.notify_all()

    def wait_for_progress_bars(self, timeout: float, while_waiting=None, batch: int = 0) -> None:
        """At the end of fit(), when the shared worker draws Composer's progress bars: wait
        (up to PROGRESS_WAIT) until it has drawn fit_end's, so they are whole when fit()
        returns, as Composer's (drawn in the loop) are, and what the user prints next comes
        below them instead of under a late redraw."""
        if "ProgressBar" in self._builtins and self.workers:
            self.wait_for_fit_end(
                min(timeout, PROGRESS_WAIT), while_waiting, batch, shared_only=True,
                waiting="fit() waits up to {:g}s for it to draw its last progress bar")

    def wait_for_fit_end(
            self, timeout: float, while_waiting=None, batch: int = 0, *, shared_only: bool = False,
            waiting: str = "close() waits up to {:g}s for it (worker_shutdown_timeout)") -> None:
        """Give every live worker (the shared one alone, with `shared_only`) until `timeout`
        to report it has handled the last fit_end (of `self.fits`) and, but with
        `shared_only` (the progress bars' wait), that its loggers have made every call up to
        it; `while_waiting` runs meanwhile (the trainer answers late control requests). A
        worker still busy after a second is logged once, with how far behind the trainer's
        `batch` it is and how long that will take at its pace."""
        started = time.monotonic()
        deadline, told = started + timeout, set()
        workers = self.workers[:1] if shared_only else self.workers
        while time.monotonic() < deadline:
            with self._lock:
                pending = [w for w in workers
                           if w.process.is_alive() and self._behind(w, shared_only)]
            if not pending:
                return
            if time.monotonic() - started >= 1.0:
                for worker in pending:
                    if id(worker) not in told:
                        told.add(id(worker))
                        log.warning("offloop: callback worker %s is %s; %s", worker.name,
                                    worker.behind(batch, self.fits), waiting.format(timeout))
            if while_waiting is not None:
                while_waiting()
            time.sleep(0.02)
        for worker in workers:
            if worker.process.is_alive() and self._behind(worker, shared_only):
                log.warning("offloop: callback worker %s had not %s after %.0fs", worker.name,
                            "handled fit_end" if worker.fits_seen < self.fits
                            else "logged everything up to fit_end", timeout)

    def _behind(self, worker: _WorkerProcess, callbacks_only: bool = False) -> bool:
        """It has not handled the last fit_end or (but with `callbacks_only`) its loggers have
        calls before it still to make."""
        return (worker.fits_seen < self.fits
                or not callbacks_only and worker.fits_delivered < self.fits)

    def stop(self, timeout: float = 10.0) -> None:
        """After the stream has closed: let workers exit, then end the ones that do not. A
        worker still behind the last fit_end has had close()'s wait for it (the run's
        worker_shutdown_timeout) and is ended at once: close() has that bound."""
        self._stopping = True
        self._stop.set()
        deadline = time.monotonic() + timeout
        for worker in self.workers:
            behind = self.fits and self._behind(worker)
            worker.process.join(timeout=0.0 if behind else max(0.0, deadline - time.monotonic()))
            if worker.process.is_alive():
                lost = ""
                if behind and worker.logs:  # queued, never made (not behind: all made): counted
                    self.logs_lost += worker.logs
                    lost = (f" ({worker.logs} logger calls queued at its last report are lost "
                            "with it)")
                log.warning("offloop: callback worker %s %s; terminating it%s", worker.name,
                            "was still behind" if behind else "did not exit", lost)
                worker.process.terminate()
                worker.process.join(timeout=5)
        if self._thread is not None:  # it reads and closes the socket pairs too: done first
            self._thread.join(timeout=2)
        for worker in self.workers:
            if not worker.conn.closed:
                worker.conn.close()
