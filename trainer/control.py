"""The trainer's side of the control path (halts, checkpoint requests, SIGTERM, the rank
agreement), handed the emitter and the checkpointer and knowing no Trainer. Promise: requests
are read once per batch, every rank halts and saves at the same batch, and each request is
answered once, never applied after its lifetime nor in a fit later than the one it arrived in.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from offloop.bus import (
    CHECKPOINT_SAVED,
    CHECKPOINT_TAKEN,
    CONTROL_REQUEST,
    ControlRequest,
    ControlServer,
    Timestamp,
)
from offloop.trainer.checkpoint import check_filename
from offloop.trainer.distributed import ControlAgreement
from offloop.trainer.errors import CheckpointError, TrainerError

__all__ = ["Control"]

log = logging.getLogger("offloop.trainer")


@dataclass
class _Taken:
    """A checkpoint taken and not yet answered: its file is being written (rank 0), or
    rank 0 has not yet said it is durable (the other ranks)."""

    requests: list[ControlRequest]
    where: str
    ts: Timestamp  # the step the file holds
    path: Path
    tag: str
    write: Any  # rank 0's checkpoint_writer.Write; None where it is written already or elsewhere
    ordinal: int  # this run's takes, counted from 1 on every rank alike


class Control:
    """What has been asked of the run, and how far the run is in answering it. It takes
    the checkpoints asked for through `checkpointer` (`take_requested(ts, requests)` ->
    (path, tag, Write or None), `durable(write)`; `writes_in_loop`: whether it takes them
    while the loop runs, or the host trainer saves later, hooked_run.py) and publishes on
    `emitter`. A checkpoint is answered (ack, checkpoint_saved) once its file is durable;
    its `taken` reply and checkpoint_taken go out when its state has been copied."""

    def __init__(
        self,
        server: ControlServer | None,
        agreement: ControlAgreement,
        emitter,
        checkpointer,
        *,
        checkpoint_on_sigterm: bool,
        saves_after_fit: bool,
    ) -> None:
        self.server, self.agreement = server, agreement
        self._emit, self._release = emitter.emit, emitter.release
        self.checkpointer = checkpointer
        self.checkpoint_on_sigterm = checkpoint_on_sigterm
        self.saves_after_fit = saves_after_fit  # one process, rank 0: a late request is still saved
        self.stop = False  # no batch after the current one trains
        self.stopped_by: dict[str, Any] | None = None
        self.sigterm = False
        self.sigterm_saved = False
        self.halts: list[ControlRequest] = []  # read, not yet applied
        self.checkpoints: list[ControlRequest] = []  # read, not yet saved
        self.due = 0  # checkpoints the ranks agreed to save at this batch's checkpoint event
        # totals carried by checkpoint_saved and control_request, so a late joiner, which
        # gets only the latest of each, still knows how many there were
        self.requests_seen = self.saves = 0
        self.given_up = 0  # requests dropped unapplied: their clients had stopped waiting
        self.outlived = 0  # requests dropped unapplied: they arrived before this fit began
        self.fit = 0  # the fits begun: the one running, or the last
        self.writing: deque[_Taken] = deque()  # taken, not yet answered (at most one on rank 0)
        self.takes = 0  # checkpoints taken so far
        self.settled = 0  # of them, answered: durable or refused (on the other ranks: rank 0's)
        # rank 0 writes every rank's checkpoint (the Trainer's): the others answer theirs only
        # once rank 0 has said its file is durable; a host trainer saves on every rank itself
        self._rank = checkpointer.rank if checkpointer.writes_for_all_ranks else 0
        #: seconds each of the latest checkpoints held the training thread (waiting for the
        #: write before it, the collective, copying the state): benchmarks/checkpoint_stall.py
        self.stalls: deque[float] = deque(maxlen=256)

    def refusals(self) -> dict[str, int]:
        """What the trainer refused unapplied, by kind (`Publisher.count_refusals`)."""
        return {"control_given_up": self.given_up, "control_outlived": self.outlived}

    # ------------------------------------------------------------ per batch

    def poll(self, ts: Timestamp) -> int:
        """Once per batch, on every rank: read what arrived, agree with the other ranks,
        apply a halt (`stop`); the number of checkpoints due at this batch's checkpoint event."""
        server = self.server
        if (
            self.halts
            or self.checkpoints
            or self.sigterm
            or self.writing
            or self.agreement.active
            or (server is not None and server.inbox)
        ):
            self.due = self._apply(server, ts)
        else:  # the usual batch: nothing asked or pending, and no other rank to agree with
            self.due = 0
        return self.due

    def _apply(self, server: ControlServer | None, ts: Timestamp) -> int:
        now = time.time()
        for request in server.poll() if server is not None else ():
            # its client stopped waiting (between two fits, say): not applied
            if request.given_up(now):
                self.given_up += 1
                request.refuse(
                    f"{request.op} from {request.client} not applied: its client stopped "
                    f"waiting {request.lifetime:g}s after sending it"
                    + (" (the lifetime of a request without `wait`)" if request.wait is None
                       else ""),
                    step=ts.batch,
                )
                if _rarely(self.given_up):  # a flood of them logs little on this thread
                    log.warning(
                        "offloop: %s from %s dropped: its client stopped waiting before the "
                        "trainer read it (%d dropped so far)",
                        request.op,
                        request.client,
                        self.given_up,
                    )
                continue
            # sent to a fit that has ended (or between it and this one): never applied here
            if request.fit < self.fit:
                self.outlived += 1
                request.refuse(
                    f"{request.op} from {request.client} arrived before fit {self.fit} began "
                    f"(during or after fit {request.fit}): not applied in a later fit than the "
                    "one it arrived in; ask again",
                    step=ts.batch,
                )
                if _rarely(self.outlived):
                    log.warning("offloop: %s from %s dropped: it arrived before fit %d began "
                                "(%d dropped so far)", request.op, request.client, self.fit,
                                self.outlived)
                continue
            self.requests_seen += 1
            self._emit(
                CONTROL_REQUEST,
                ts.as_tuple(),
                {
                    "op": request.op,
                    "client": request.client,
                    "args": request.args,
                    "count": self.requests_seen,
                },
            )
            if request.op == "halt":
                self.halts.append(request)
                continue
            # a bad file name is refused now, alone: it never joins the requests saved together
            try:
                check_filename(request.args.get("filename"))
            except CheckpointError as exc:
                request.refuse(str(exc), step=ts.batch)
                continue
            self.checkpoints.append(request)
        sigterm_checkpoint = int(self.sigterm and self.checkpoint_on_sigterm)
        halt, due, settled = self.agreement.agree(
            bool(self.halts) or self.sigterm,
            len(self.checkpoints) + sigterm_checkpoint,
            self.settled if self._rank == 0 else 0,  # the others learn rank 0's
        )
        self._answer_durable(settled)
        if halt:
            self.stop = True  # applied: no batch after this one trains, on any rank
            for request in self.halts:
                request.ack(step=ts.batch, epoch=ts.epoch)
                self.stopped_by = {
                    "reason": request.args.get("reason", ""),
                    "client": request.client,
                    "step": ts.batch,
                }
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

    def save_due(self, where: str, ts: Timestamp) -> None:
        """The one place requested checkpoints are written: one per group of take_due() (an
        empty group: a SIGTERM's, or another rank's share of rank 0's), each request acked
        with the file or refused with why it could not be; checkpoint_saved published at
        once. Nothing where the host trainer saves later (it takes them: take_due())."""
        if self.due and self.checkpointer.writes_in_loop:
            self._save(where, self.take_due(), ts)

    def _save(self, where: str, due: list[list[ControlRequest]], ts: Timestamp) -> None:
        for requests in due:
            began = time.perf_counter()
            self.wait_durable()  # one write at a time: the one in flight is answered first
            try:
                path, tag, write = self.checkpointer.take_requested(ts, requests)
            except CheckpointError as exc:
                self.checkpoint_refused(requests, exc, ts)
                continue
            finally:
                self.stalls.append(time.perf_counter() - began)
            self.takes += 1
            self.sigterm_saved = self.sigterm_saved or self.sigterm  # taken: never taken twice
            self.writing.append(_Taken(requests, where, ts, path, tag, write, self.takes))
            for request in requests:
                request.taken(path=str(path), step=ts.batch, event=where)
            self._emit(CHECKPOINT_TAKEN, ts.as_tuple(), self._about(path, tag, where, ts, requests))
        self._answer_durable()
        self._release()

    def _answer_durable(self, settled: int | None = None) -> None:
        """Answer the checkpoints whose files are durable (or failed) by now, in order: on
        rank 0 those its writer has finished; on the others those rank 0 has answered
        (`settled`, from the agreement)."""
        writing = self.writing
        while writing:
            taken = writing[0]
            if self._rank != 0:
                if settled is None or taken.ordinal > settled:
                    return
            elif taken.write is not None and not taken.write.done():
                return
            writing.popleft()
            self.settled += 1
            try:
                if taken.write is not None:
                    self.checkpointer.durable(taken.write)
            except CheckpointError as exc:
                self.checkpoint_refused(taken.requests, exc, taken.ts)
            else:
                self.checkpoint_saved(taken.requests, taken.path, taken.tag, taken.where, taken.ts)

    def wait_durable(self) -> None:
        """Rank 0: until the write in flight is durable (or failed), then answer it; the
        other ranks go on (their answers follow rank 0's, poll())."""
        if self._rank == 0:
            for taken in self.writing:
                if taken.write is not None:
                    taken.write.wait()
            self._answer_durable()

    def finish_writes(self, *, agree: bool = True) -> None:
        """The fit has ended (or the run closes): every checkpoint taken is durable and
        answered before this returns. Under torchrun, with `agree` (every rank reaches this
        point at the same batch), one more agreement tells the other ranks which of rank
        0's files are durable; without it (an exception unwinds the fit) they drop what
        they still owe, said in the log."""
        self.wait_durable()
        if self.agreement.active and agree and self.checkpointer.writes_for_all_ranks:
            _, _, settled = self.agreement.agree(False, 0, self.settled if self._rank == 0 else 0)
            self._answer_durable(settled)
        if self.writing:
            log.warning("offloop: %d checkpoint_saved event(s) not published on rank %d: the fit "
                        "ended by an error before rank 0 said its files were durable",
                        len(self.writing), self._rank)
            self.writing.clear()

    def serve(self, where: str, ts: Timestamp) -> None:
        """While the loop waits at a decision (trainer/decisions.py): a halt is applied, a
        checkpoint taken now, one whose file became durable answered."""
        self.poll(ts)
        self.save_due(where, ts)
        self._answer_durable()

    def checkpoint_saved(self, requests: list[ControlRequest], path: Path, tag: str, where: str,
                         ts: Timestamp) -> None:
        """Ack the requests with the durable file of step `ts` and publish checkpoint_saved,
        stamped with that step (as when it was written in the loop), whenever it is
        published: at the first batch end after the file became durable."""
        self.sigterm_saved = self.sigterm_saved or self.sigterm
        for request in requests:
            request.ack(path=str(path), step=ts.batch, event=where)
        self.saves += 1
        self._emit(CHECKPOINT_SAVED, ts.as_tuple(),
                   {**self._about(path, tag, where, ts, requests), "count": self.saves})

    @staticmethod
    def _about(path: Path, tag: str, where: str, ts: Timestamp,
               requests: list[ControlRequest]) -> dict[str, Any]:
        return {"path": str(path), "step": ts.batch, "tag": tag, "event": where,
                "requested_by": [[r.client, r.req] for r in requests]}

    def checkpoint_refused(
        self, requests: list[ControlRequest], exc: CheckpointError, ts: Timestamp
    ) -> None:
        for request in requests:
            request.refuse(str(exc), step=ts.batch)
        log.warning("offloop: %s; training goes on", exc)

    def request_halt(self, reason: str) -> None:
        """In-process twin of a halt request: stop after the current batch. The reason is
        a str, as on the wire: it goes into run.json and every stopped_by."""
        if not isinstance(reason, str):
            raise TrainerError(
                f"request_halt(reason) takes a str, got {type(reason).__name__} {reason!r}"
            )
        self.stop = True
        self.stopped_by = {"reason": reason, "client": "in-process"}

    # --------------------------------------------------------- fit boundaries

    def begin_fit(self) -> None:
        """A fit begins: requests that arrive from now on are stamped with its number, and
        those that arrived before it (after the first fit) are refused when read."""
        self.stop = False
        self.fit += 1
        if self.server is not None:
            self.server.fit = self.fit

    def end_loop(self, ts: Timestamp) -> None:
        """The loop has ended: a SIGTERM checkpoint still owed is written now. SIGTERM came
        after the last batch boundary (in an evaluation, say) when nothing saved it yet;
        under torchrun the ranks agreed at a boundary."""
        if self.sigterm:
            self._stopped_by_sigterm(ts)
        if (
            self.sigterm
            and self.checkpoint_on_sigterm
            and not self.sigterm_saved
            and not self.agreement.active
        ):
            self._save("fit_end", [[]], ts)

    def refuse_pending(self, ts: Timestamp) -> None:
        """Requests that arrived with the last batch: the run finished before them."""
        for request in self.halts + self.checkpoints:
            request.refuse("the run finished before this request could be applied", step=ts.batch)
        self.halts, self.checkpoints = [], []

    def answer_late(self, ts: Timestamp) -> None:
        """Requests that come after training stopped (at `ts`): a checkpoint is still
        written (of the final weights) and acked; a halt is refused — nothing is left to stop."""
        if self.server is None:
            return
        for request in self.server.poll():
            if request.op == "checkpoint" and self.saves_after_fit:
                self._save("after_fit", [[request]], ts)
                self.wait_durable()  # no loop left to keep going: answered once durable
            else:
                request.refuse("the run has finished", step=ts.batch)

    def _stopped_by_sigterm(self, ts: Timestamp) -> None:
        if self.sigterm and self.stopped_by is None:
            self.stopped_by = {"reason": "SIGTERM", "client": "signal", "step": ts.batch}

    def on_sigterm(self) -> None:
        """A SIGTERM arrived (the handler is RunServices'): the loop stops after its batch
        (under torchrun the ranks agree at the next batch end) and, with
        checkpoint_on_sigterm, checkpoints."""
        self.sigterm = True
        if not self.agreement.active:
            self.stop = True


def _rarely(count: int) -> bool:
    """Whether the `count`th of a kind of message is logged: the 1st, 2nd, 4th, 8th, ..."""
    return count & (count - 1) == 0
