"""Worker processes for a Trainer's `callbacks=[...]`: spawned, awaited, supervised.

Each callback object runs in its own process (multiprocessing "spawn"). The trainer
waits until every worker is listening before it publishes `init`, never waits on a
worker while training, reports a worker that dies, and at the end gives each one
until the run's last `fit_end` has reached it before it closes the stream (a Trainer
may fit() several times: a worker lives through all of them, and a death between or
during later fits is reported and restarted like one in the first).

The worker runtime is a separate program, found by module name: `trainer` never
imports `workers` (the design brief keeps them independent).
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing as mp
import os
import pickle
import threading
import time
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from offloop.trainer.errors import ConfigError

__all__ = ["CallbackWorkers", "WORKER_ENTRY", "check_picklable"]

WORKER_ENTRY = "offloop.workers.runtime:serve_trainer_callback"
log = logging.getLogger("offloop.trainer")


def _child(entry: str, callback: Any, run_dir: str, conn, keys: str | None,
           heartbeat_timeout: float, nice: int = 0) -> None:
    if nice:
        _lower_priority(nice)
    module, func = entry.split(":")
    getattr(importlib.import_module(module), func)(callback, run_dir, conn, keys, heartbeat_timeout)


def _lower_priority(nice: int) -> None:
    """Add `nice` to this process's nice value: to the threads it has already (unpickling
    the callback imported its modules, which may start thread pools), and, first, to this
    one, so every thread it starts later (ZeroMQ's among them) inherits it."""
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


def check_picklable(callbacks: list) -> None:
    """Each callback is sent to its worker process by pickle: refuse one that cannot be."""
    for callback in callbacks:
        try:
            pickle.dumps(callback)
        except Exception as exc:
            raise ConfigError(
                f"callback {type(callback).__name__} cannot be sent to its worker process "
                f"(it must be picklable, and its class importable): {exc}"
            ) from None


class _Worker:
    def __init__(self, callback: Any, process, conn) -> None:
        self.callback, self.process, self.conn = callback, process, conn
        self.name = type(callback).__name__
        self.ready = False
        self.fits_seen = 0  # the number of the last fit whose fit_end it has handled
        self.reported_dead = False
        self.gone = False  # its exit has been handled (reported, restarted, or a clean end)
        self.restarts = 0
        self.report: dict = {}


class CallbackWorkers:
    """One process per callback; see the module docstring."""

    def __init__(self, callbacks: list, run_dir: str, ready_timeout: float = 120.0,
                 keys: str | None = None, max_restarts: int = 3,
                 heartbeat_timeout: float = 10.0, nice: int = 10) -> None:
        self.callbacks = list(callbacks)
        #: added to each worker's nice value: on a CPU it shares with the training loop, the
        #: loop comes first (a worker catches up in the gaps; its queue is bounded and counted)
        self.nice = nice
        #: a worker whose trainer sends no heartbeat for this long closes its callbacks and exits
        self.heartbeat_timeout = heartbeat_timeout
        self.keys = keys  # the keys folder, when the run has keys: workers use its "workers" key
        self.max_restarts = max_restarts  # per worker; a restarted worker joins from the late-join state
        self.restarts = 0
        self._ctx = mp.get_context("spawn")
        self._stopping = False
        #: fit_end events the trainer has published; a worker's exit is its end (not a
        #: crash) only once the trainer closes the stream and the worker has handled them all
        self.fits = 0
        self.closing = False
        self.run_dir = run_dir
        self.ready_timeout = ready_timeout
        self.workers: list[_Worker] = []
        self.crashes: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Spawn every worker and return once each is listening (or has failed)."""
        if not self.callbacks:
            return
        check_picklable(self.callbacks)
        for callback in self.callbacks:
            self.workers.append(self._spawn(callback))
        deadline = time.monotonic() + self.ready_timeout
        while not all(w.ready or not w.process.is_alive() for w in self.workers):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._receive(timeout=min(left, 0.5))
        for worker in self.workers:
            if not worker.ready:
                self._dead(worker, "did not start listening before init")
        self._thread = threading.Thread(target=self._supervise, daemon=True,
                                        name="offloop-supervisor")
        self._thread.start()

    def _spawn(self, callback: Any) -> _Worker:
        parent, child = self._ctx.Pipe()
        process = self._ctx.Process(target=_child, args=(WORKER_ENTRY, callback, self.run_dir, child, self.keys,
                                          self.heartbeat_timeout, self.nice),
                                    name=f"offloop-worker-{type(callback).__name__}", daemon=True)
        process.start()
        child.close()
        return _Worker(callback, process, parent)

    def _restart(self, worker: _Worker) -> None:
        """Start a fresh process for a worker that died; it carries on from the late-join state."""
        if self._stopping or worker.restarts >= self.max_restarts:
            return
        fresh = self._spawn(worker.callback)
        fresh.restarts = worker.restarts + 1
        with self._lock:
            self.workers[self.workers.index(worker)] = fresh
            self.restarts += 1
        log.warning("offloop: restarted callback worker %s (pid %s, restart %d of %d)",
                    fresh.name, fresh.process.pid, fresh.restarts, self.max_restarts)

    def _receive(self, timeout: float) -> None:
        conns = [w.conn for w in self.workers if not w.conn.closed]
        # every worker whose exit is not handled yet, alive or not: one that died since the
        # last call has a ready sentinel, so no death goes unseen
        sentinels = [w.process.sentinel for w in self.workers if not w.gone]
        for ready in wait(conns + sentinels, timeout=timeout):
            for worker in list(self.workers):
                if ready is worker.conn:
                    self._message(worker)
                elif ready == worker.process.sentinel and not worker.gone:
                    worker.process.join()
                    worker.gone = True
                    self._drain(worker)
                    if not (self.closing and worker.fits_seen >= self.fits):
                        self._dead(worker, f"exited with code {worker.process.exitcode}")
                        if worker.ready:
                            self._restart(worker)

    def _message(self, worker: _Worker) -> None:
        try:
            kind, payload = worker.conn.recv()
        except (EOFError, OSError):
            worker.conn.close()
            return
        with self._lock:
            if kind == "ready":
                worker.ready = True
            elif kind == "fit_end":
                worker.fits_seen = max(worker.fits_seen, int(payload.get("fit") or 1))
                worker.report = payload
            elif kind == "error":
                log.warning("offloop: worker %s: %s", worker.name, payload)

    def _drain(self, worker: _Worker) -> None:
        while not worker.conn.closed and worker.conn.poll(0):
            self._message(worker)

    def _dead(self, worker: _Worker, why: str) -> None:
        with self._lock:
            if worker.reported_dead:
                return
            worker.reported_dead = True
            message = f"callback worker {worker.name} (pid {worker.process.pid}) {why}; training goes on"
            self.crashes.append(message)
        log.warning("offloop: %s", message)

    def _supervise(self) -> None:
        while not self._stop.is_set():
            if all(w.gone for w in self.workers):
                return
            self._receive(timeout=0.5)

    def wait_for_fit_end(self, timeout: float, while_waiting=None) -> None:
        """Give every live worker until `timeout` to report it has handled the last
        fit_end (of `self.fits`); `while_waiting` runs meanwhile (the trainer answers late
        control requests)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                pending = [w for w in self.workers if w.process.is_alive() and w.fits_seen < self.fits]
            if not pending:
                return
            if while_waiting is not None:
                while_waiting()
            time.sleep(0.02)
        for worker in self.workers:
            if worker.process.is_alive() and worker.fits_seen < self.fits:
                log.warning("offloop: callback worker %s had not handled fit_end after %.0fs",
                            worker.name, timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """After the stream has closed: let workers exit, then end the ones that do not."""
        self._stopping = True
        self._stop.set()
        deadline = time.monotonic() + timeout
        for worker in self.workers:
            worker.process.join(timeout=max(0.0, deadline - time.monotonic()))
            if worker.process.is_alive():
                log.warning("offloop: callback worker %s did not exit; terminating it", worker.name)
                worker.process.terminate()
                worker.process.join(timeout=5)
            worker.conn.close()
        if self._thread is not None:
            self._thread.join(timeout=2)
