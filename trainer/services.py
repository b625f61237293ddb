"""A run's services in one owner: the sockets (publisher, control server, run.json), the
callback workers, the emitter, the control path, the decision waits and the checkpointer.
Promise: whoever drives the run (offloop's Trainer, or a host trainer's hooks: hooked_run.py)
they are wired the same way, and start, begin and end each fit, and close once, here."""

from __future__ import annotations

import multiprocessing
import os
import signal
import weakref
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from offloop.bus import Timestamp, Topic
from offloop.trainer.control import Control
from offloop.trainer.decisions import Decisions
from offloop.trainer.distributed import ControlAgreement
from offloop.trainer.snapshot import RunFirst, open_emitter
from offloop.trainer.startup import RunSockets, check_keys
from offloop.trainer.supervisor import CallbackWorkers

__all__ = ["RunServices", "ServiceSettings"]


@dataclass(frozen=True)
class ServiceSettings:
    """The settings of a run's services, as `Trainer` and `HookedRun` take them."""

    host: str = "127.0.0.1"
    keys: str | os.PathLike | None = None
    insecure: bool = False
    heartbeat_interval: float = 0.5
    burst_interval: float = 0.005
    worker_shutdown_timeout: float = 60.0
    worker_nice: int = 10
    decision_timeout: float = 30.0
    #: a SIGTERM checkpoints before fit_end (the Trainer's; a host trainer owns its signals)
    checkpoint_on_sigterm: bool = False


class RunServices:
    """Built in the order a run needs them: the workers (their callbacks serialized, so one
    that cannot travel fails before a socket or run.json exists), the sockets (with
    `publish`), the emitter (the algorithms' `run_first` wrapped in before anything holds
    it), `control` (handed the emitter and the checkpointer) and `decisions`.

    Then `start()`, `begin_fit()` / `end_fit()` around each fit, and `close()` once; the
    lifecycle's flags (`in_fit`, `fit_ended`, `closed`) are kept here. `publisher` and
    `server` (the ControlServer, rank 0) are None without `publish`.
    """

    def __init__(self, settings: ServiceSettings, *, callbacks: list, loggers: list | None,
                 builtins: dict | None, run_id: str, run_name: str, run_dir: Path,
                 config: dict[str, Any], rank: int, world_size: int, agreement: ControlAgreement,
                 device: torch.device, checkpointer, publish: bool = True,
                 run_first: RunFirst | None = None) -> None:
        self.settings, self.rank, self.checkpointer = settings, rank, checkpointer
        server_keys = (check_keys(settings.keys, settings.host, settings.insecure)
                       if publish else None)
        # a worker that hears no heartbeat for 10 intervals (3 s at least) takes the trainer
        # for dead
        self.workers = CallbackWorkers(
            callbacks, str(run_dir), loggers=loggers, builtins=builtins,
            keys=server_keys.client_keys("workers") if server_keys else None,
            heartbeat_timeout=max(3.0, 10 * settings.heartbeat_interval), nice=settings.worker_nice)
        self.sockets: RunSockets | None = None
        if publish:
            self.sockets = RunSockets(run_id, server_keys, rank=rank, host=settings.host,
                                      heartbeat_interval=settings.heartbeat_interval)
            self.sockets.start(agreement, run_dir, run_name, world_size, config)
        self.publisher = self.sockets.publisher if self.sockets else None
        self.server = self.sockets.control if self.sockets else None
        self.emitter = open_emitter(self.publisher, device, float(settings.burst_interval),
                                    run_first)
        self.control = Control(self.server, agreement, self.emitter, checkpointer,
                               checkpoint_on_sigterm=settings.checkpoint_on_sigterm,
                               saves_after_fit=rank == 0 and world_size == 1)
        if self.server is not None:  # heartbeats count what the trainer refused too
            self.publisher.count_refusals(self.control.refusals)
        # waits at decisions are one process's: under torchrun every rank polls per batch
        schedule = self.workers.decision_schedule if world_size == 1 else {}
        self.decisions = Decisions(schedule, float(settings.decision_timeout), self.emitter,
                                   self.workers, self.control)
        if self.server is not None and schedule:
            self.server.on_request = self.workers.wake  # a request wakes a wait: answered at once
        self.in_fit = False
        self.fit_ended = False  # a fit_end was published: close() waits for workers to see it
        self.closed = False
        self._sigterm: tuple | None = None  # (our SIGTERM handler, the one before it)

    @property
    def stopped_by(self) -> dict[str, Any] | None:
        """Who halted the run (reason, client, step), or None."""
        return self.control.stopped_by

    @property
    def checkpoints(self) -> list[str]:
        """Every checkpoint file written, in order."""
        return self.checkpointer.written

    # ---------------------------------------------------------------- lifecycle

    def start(self, *, handle_sigterm: bool) -> None:
        """Every worker listening (rank 0) before init is published; with `handle_sigterm`,
        SIGTERM ends the run at a batch boundary (install_sigterm())."""
        if self.rank == 0:
            self.workers.start()
        if handle_sigterm:
            self.install_sigterm()

    def begin_fit(self) -> None:
        self.control.begin_fit()
        self.in_fit = True

    def end_fit(self, ts: Timestamp, *, wait_for_progress_bars: bool = False,
                completed: bool = True) -> None:
        """The fit has ended at `ts`: every checkpoint taken is durable and answered, the
        requests it finished before are refused, fit_end (who stopped it, the checkpoints
        written, the fit's number) is sent at once; with `wait_for_progress_bars`, until the
        worker drawing them has drawn the last one (a checkpoint asked for meanwhile is
        durable before this returns too). `completed`: every rank reached the fit's end
        alike (not an exception unwinding it): the ranks agree once more on rank 0's files."""
        self.in_fit = False
        control = self.control
        control.finish_writes(agree=completed)
        control.refuse_pending(ts)
        fit = self.workers.fit_ended()  # its workers are stopped only once they have handled it
        self.emitter.emit(Topic.FIT_END, ts.as_tuple(), {
            "stopped_by": control.stopped_by, "checkpoints": self.checkpoints, "fit": fit})
        self.emitter.flush()
        self.fit_ended = True
        if wait_for_progress_bars:
            self.workers.wait_for_progress_bars(self.settings.worker_shutdown_timeout,
                                                partial(control.answer_late, ts), ts.batch)
            control.finish_writes(agree=False)  # one answer_late took meanwhile

    def close(self, ts: Timestamp, wait_for_workers: bool = True) -> None:
        """Let every worker see fit_end, answer what came late, close the stream and the
        workers, mark run.json finished with `ts`'s progress. Once; later calls do nothing."""
        if self.closed:
            return
        self.closed = True
        self.uninstall_sigterm()
        workers, control = self.workers, self.control
        workers.begin_closing()
        # with no fit (only eval() or predict()) there is no fit_end to wait for: the
        # workers take the stream's final heartbeats as the end, after every event before them
        if workers.workers and wait_for_workers and self.fit_ended:
            workers.wait_for_fit_end(self.settings.worker_shutdown_timeout,
                                     partial(control.answer_late, ts), ts.batch)
        control.answer_late(ts)
        control.finish_writes(agree=False)  # after the fit: one process, rank 0 alone
        if self.sockets is None:
            return workers.stop()
        progress = {"epoch": ts.epoch, "batch": ts.batch, "sample": ts.sample, "token": ts.token}
        self.sockets.close(workers.stop, stopped_by=control.stopped_by,
                           checkpoints=self.checkpoints, progress=progress)

    # ------------------------------------------------------------------ SIGTERM

    def install_sigterm(self) -> None:
        """SIGTERM: the loop stops after its batch, checkpoints (checkpoint_on_sigterm) and
        publishes fit_end; outside a fit the process exits at once and atexit closes the run
        (never from inside the handler). The handler holds these services weakly: a closed
        run is freed even while a later run's handler chains to its own."""
        if multiprocessing.current_process().name != "MainProcess":
            return
        try:
            previous = signal.getsignal(signal.SIGTERM)
        except ValueError:
            return
        services_ref = weakref.ref(self)

        def handler(signum, frame):
            services = services_ref()
            if services is None or services.closed:
                if callable(previous):
                    previous(signum, frame)
                raise SystemExit(128 + signum)
            services.control.on_sigterm()
            if not services.in_fit:
                # the run is closed by atexit once this exit has unwound the main thread: closing
                # here could wait for a lock the interrupted code holds (the publisher's send)
                raise SystemExit(128 + signum)

        try:
            signal.signal(signal.SIGTERM, handler)
        except ValueError:  # not the main thread
            return
        self._sigterm = (handler, previous)

    def uninstall_sigterm(self) -> None:
        """Put back the SIGTERM handler there was before, if ours is still the one installed
        (a run built since keeps its own, which passes a SIGTERM on to ours)."""
        handler, previous = self._sigterm or (None, None)
        self._sigterm = None
        try:
            if handler is not None and signal.getsignal(signal.SIGTERM) is handler:
                signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        except ValueError:  # not the main thread: it stays, and does nothing once closed
            pass
