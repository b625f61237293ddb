"""The trainer's side of the control path (halts, checkpoint requests, SIGTERM, the rank
agreement), handed what it calls and knowing no Trainer. Promise: requests are read once
per batch, every rank halts and saves at the same batch, and each request is answered once.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from offloop.bus import CHECKPOINT_SAVED, CONTROL_REQUEST, ControlRequest, ControlServer, Timestamp
from offloop.trainer.checkpoint import check_filename
from offloop.trainer.distributed import ControlAgreement
from offloop.trainer.errors import CheckpointError, TrainerError

__all__ = ["Control"]

log = logging.getLogger("offloop.trainer")


class Control:
    """What has been asked of the run, and how far the run is in answering it."""

    def __init__(self, server: ControlServer | None, agreement: ControlAgreement,
                 emit: Callable[..., Any], *, checkpoint_on_sigterm: bool, saves_after_fit: bool,
                 write: Callable[[list[ControlRequest]], tuple[Path, str]],
                 now: Callable[[], Timestamp], release: Callable[[], None]) -> None:
        self.server, self.agreement, self._emit = server, agreement, emit
        # the trainer's: write(requests) -> (path, tag) a checkpoint of the step now(), and
        # release() its held events (checkpoint_saved leaves at once)
        self._write, self._now, self._release = write, now, release
        self.checkpoint_on_sigterm = checkpoint_on_sigterm
        self.saves_after_fit = saves_after_fit  # one process, rank 0: a late request is still saved
        self.stop = False  # no batch after the current one trains
        self.stopped_by: dict[str, Any] | None = None
        self.sigterm = False
        self.sigterm_saved = False
        self.halts: list[ControlRequest] = []  # read, not yet applied
        self.checkpoints: list[ControlRequest] = []  # read, not yet saved
        self.due = 0  # checkpoints the ranks agreed to save at this batch's checkpoint event
        self.in_fit = False
        self.fit_ended = False  # fit_end was published: close() waits for workers to see it
        self.closed = False
        self._sigterm: tuple | None = None  # (our SIGTERM handler, the one before it)
        # totals carried by checkpoint_saved and control_request, so a late joiner, which
        # gets only the latest of each, still knows how many there were
        self.requests_seen = self.saves = 0
        self.given_up = 0  # requests dropped unapplied: their clients had stopped waiting

    # ------------------------------------------------------------ per batch

    def poll(self, ts: Timestamp) -> int:
        """Once per batch, on every rank: read what arrived, agree with the other ranks,
        apply a halt (`stop`); the number of checkpoints due at this batch's checkpoint event."""
        server = self.server
        if (self.halts or self.checkpoints or self.sigterm or self.agreement.active
                or (server is not None and server.inbox)):
            self.due = self._apply(server, ts)
        else:  # the usual batch: nothing asked or pending, and no other rank to agree with
            self.due = 0
        return self.due

    def _apply(self, server: ControlServer | None, ts: Timestamp) -> int:
        now = time.time()
        for request in server.poll() if server is not None else ():
            if request.given_up(now):  # its client stopped waiting (between two fits, say): not applied
                self.given_up += 1
                request.refuse(f"{request.op} from {request.client} not applied: its client stopped "
                               f"waiting {request.wait:g}s after sending it", step=ts.batch)
                log.warning("offloop: %s from %s dropped: its client stopped waiting before the trainer "
                            "read it", request.op, request.client)
                continue
            self.requests_seen += 1
            self._emit(CONTROL_REQUEST, ts.as_tuple(), {"op": request.op, "client": request.client,
                                                        "args": request.args, "count": self.requests_seen})
            if request.op == "halt":
                self.halts.append(request)
                continue
            try:  # a bad file name is refused now, alone: it never joins the requests saved together
                check_filename(request.args.get("filename"))
            except CheckpointError as exc:
                request.refuse(str(exc), step=ts.batch)
                continue
            self.checkpoints.append(request)
        sigterm_checkpoint = int(self.sigterm and self.checkpoint_on_sigterm)
        halt, due = self.agreement.agree(bool(self.halts) or self.sigterm,
                                         len(self.checkpoints) + sigterm_checkpoint)
        if halt:
            self.stop = True  # applied: no batch after this one trains, on any rank
            for request in self.halts:
                request.ack(step=ts.batch, epoch=ts.epoch)
                self.stopped_by = {"reason": request.args.get("reason", ""), "client": request.client,
                                   "step": ts.batch}
            self.halts = []
            self._stopped_by_sigterm(ts)
        return due

    def take_due(self) -> list[list[ControlRequest]]:
        """The checkpoints due now, each as the requests it answers: one request each, so no
        client is answered with a file another asked for, and no empty group but a SIGTERM's
        (or, under torchrun, one of rank 0's on the other ranks): every rank writes as many."""
        due, requests = self.due, self.checkpoints
        self.due, self.checkpoints = 0, []
        return [[request] for request in requests] + [[] for _ in range(due - len(requests))]

    def save(self, where: str, due: list[list[ControlRequest]]) -> None:
        """Write one checkpoint per group of `due` (take_due(); an empty group: a SIGTERM's,
        or another rank's share of rank 0's) and answer its requests: acked with the file,
        or refused with why it could not be; checkpoint_saved published at once."""
        ts = self._now()
        for requests in due:
            try:
                path, tag = self._write(requests)
            except CheckpointError as exc:
                self.checkpoint_refused(requests, exc, ts)
            else:
                self.checkpoint_saved(requests, path, tag, where, ts)
        self._release()

    def serve(self, where: str) -> None:
        """While the loop waits at a decision (trainer/decisions.py): a halt is applied, a
        checkpoint written now."""
        if self.poll(self._now()):
            self.save(where, self.take_due())

    def checkpoint_saved(self, requests: list[ControlRequest], path: Path, tag: str, where: str,
                         ts: Timestamp) -> None:
        """Ack the requests with the file written and publish checkpoint_saved."""
        self.sigterm_saved = self.sigterm_saved or self.sigterm
        for request in requests:
            request.ack(path=str(path), step=ts.batch, event=where)
        self.saves += 1
        self._emit(CHECKPOINT_SAVED, ts.as_tuple(),
                   {"path": str(path), "step": ts.batch, "tag": tag, "event": where,
                    "requested_by": [[r.client, r.req] for r in requests], "count": self.saves})

    def checkpoint_refused(self, requests: list[ControlRequest], exc: CheckpointError, ts: Timestamp) -> None:
        for request in requests:
            request.refuse(str(exc), step=ts.batch)
        log.warning("offloop: %s; training goes on", exc)

    def request_halt(self, reason: str) -> None:
        """In-process twin of a halt request: stop after the current batch. The reason is
        a str, as on the wire: it goes into run.json and every stopped_by."""
        if not isinstance(reason, str):
            raise TrainerError(f"request_halt(reason) takes a str, got {type(reason).__name__} {reason!r}")
        self.stop = True
        self.stopped_by = {"reason": reason, "client": "in-process"}

    # --------------------------------------------------------- fit boundaries

    def begin_fit(self) -> None:
        self.stop, self.in_fit = False, True

    def end_loop(self, ts: Timestamp) -> bool:
        """The loop has ended: whether a SIGTERM checkpoint is still owed. SIGTERM came
        after the last batch boundary (in an evaluation, say) when nothing saved it yet;
        under torchrun the ranks agreed at a boundary."""
        if self.sigterm:
            self._stopped_by_sigterm(ts)
        return (self.sigterm and self.checkpoint_on_sigterm and not self.sigterm_saved
                and not self.agreement.active)

    def refuse_pending(self, ts: Timestamp) -> None:
        """Requests that arrived with the last batch: the run finished before them."""
        for request in self.halts + self.checkpoints:
            request.refuse("the run finished before this request could be applied", step=ts.batch)
        self.halts, self.checkpoints = [], []

    def answer_late(self) -> None:
        """Requests that come after training stopped: a checkpoint is still written (of the
        final weights) and acked; a halt is refused — nothing is left to stop."""
        if self.server is None:
            return
        for request in self.server.poll():
            if request.op == "checkpoint" and self.saves_after_fit:
                self.save("after_fit", [[request]])
            else:
                request.refuse("the run has finished", step=self._now().batch)

    def _stopped_by_sigterm(self, ts: Timestamp) -> None:
        if self.sigterm and self.stopped_by is None:
            self.stopped_by = {"reason": "SIGTERM", "client": "signal", "step": ts.batch}

    # ---------------------------------------------------------------- SIGTERM

    def install_sigterm(self) -> None:
        """SIGTERM: the loop stops after its batch, checkpoints (checkpoint_on_sigterm) and
        publishes fit_end; outside fit() the process exits at once and atexit closes the run
        (never from inside the handler). The handler holds this Control weakly: a closed
        Trainer is freed even while a later Trainer's handler chains to its own."""
        if multiprocessing.current_process().name != "MainProcess":
            return
        try:
            previous = signal.getsignal(signal.SIGTERM)
        except ValueError:
            return
        control_ref = weakref.ref(self)

        def handler(signum, frame):
            control = control_ref()
            if control is None or control.closed:
                if callable(previous):
                    previous(signum, frame)
                raise SystemExit(128 + signum)
            control.sigterm = True
            if not control.agreement.active:  # under torchrun the ranks agree at the next batch end
                control.stop = True
            if not control.in_fit:
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
        (a Trainer built since keeps its own, which passes a SIGTERM on to ours)."""
        handler, previous = self._sigterm or (None, None)
        self._sigterm = None
        try:
            if handler is not None and signal.getsignal(signal.SIGTERM) is handler:
                signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        except ValueError:  # not the main thread: it stays, and does nothing once closed
            pass
