"""Composer's `CheckpointSaver`, deciding in a worker process: the trainer writes each file.

The schedule is evaluated at batch/epoch/iteration checkpoint events; each save is a
checkpoint request, sent in order from a background thread. From the acknowledged
paths the saver keeps the newest `num_checkpoints_to_keep` and points `latest` at the
newest, all on the worker's side.
"""

from __future__ import annotations

import glob
import os
import queue
import shutil
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from offloop.bus import Event, Time, TimeUnit
from offloop.bus.duration import DurationError
from offloop.workers.callback import Callback
from offloop.workers.state import Timestamp

__all__ = ["CheckpointSaver"]

_NAME_FIELDS = {"run_name": "run", "rank": 0, "epoch": 1, "batch": 2, "sample": 3, "token": 4}
_FOLDER_FIELDS = {"run_name": "run", "rank": 0}


@dataclass
class Save:
    """One checkpoint this saver asked for: when it decided, and what the trainer answered."""

    asked_at: Timestamp
    step: int | None = None
    path: str | None = None
    error: str | None = None
    #: set once the trainer has taken it (the step fixed, the file being written) or answered
    taken: threading.Event = field(default_factory=threading.Event, repr=False, compare=False)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "taken"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, taken=threading.Event())
        if self.step is not None or self.error is not None:
            self.taken.set()


class _Every:
    """Composer's interval scheduler seen from a worker: True at the checkpoint event of
    each interval boundary crossed since the previous such event."""

    def __init__(self, interval: Time | str | int) -> None:
        if isinstance(interval, bool):
            raise ValueError(f"CheckpointSaver: save_interval {interval!r} is not a duration")
        try:
            self.interval = (Time(interval, TimeUnit.EPOCH) if isinstance(interval, int)
                             else Time.parse(interval))
        except DurationError as exc:
            raise ValueError(f"CheckpointSaver: save_interval: {exc}; or pass a callable "
                             "(state, event) -> bool") from None
        unit = self.interval.unit
        self.event = Event.EPOCH_CHECKPOINT if unit is TimeUnit.EPOCH else Event.BATCH_CHECKPOINT
        self._previous: int | None = None

    def start(self, timestamp: Timestamp) -> None:
        self._previous = timestamp.get(self.interval.unit)

    def __call__(self, state, event) -> bool:
        if getattr(event, "value", event) != self.event.value:
            return False
        unit = self.interval.unit
        count = state.timestamp.get(unit)
        previous = self._previous
        if previous is None:  # joined mid-run: count only the step just taken
            step = {TimeUnit.EPOCH: 1, TimeUnit.BATCH: 1, TimeUnit.SAMPLE: state.batch_size or 0}
            previous = count - step.get(unit, 0)
        self._previous = count
        return self.interval.crossed(previous, count)


class CheckpointSaver(Callback):
    """Save checkpoints on a schedule, keep the newest N, point `latest` at the newest.

    Args:
        folder: where the checkpoints end up (`{run_name}` is filled in). None: the
            trainer's save_folder, where it writes them. Otherwise each file the
            trainer wrote for this saver is moved there once acknowledged.
        filename: None: the trainer names each file after the step it saved
            (`ep{epoch}-ba{batch}.pt`). A format string ('ep{epoch}-ba{batch}.pt',
            fields run_name, rank, epoch, batch, sample, token) is filled in with the
            timestamp at which the save was *decided*: with a batch or epoch interval
            the step the file holds (the trainer waits for the decision); otherwise the
            file holds the step the ack reports, one batch or more later.
        latest_filename: the symlink to the newest checkpoint, beside it (`{run_name}`,
            `{rank}` are filled in); None for no symlink.
        save_interval: '1ep', '500ba', '10000sp', '1000tok', an int (epochs) or a
            callable (state, event) -> bool called at each batch_checkpoint,
            epoch_checkpoint and iteration_checkpoint.
        num_checkpoints_to_keep: how many of this saver's checkpoints to keep; the
            oldest are deleted first. -1 keeps all; 0 deletes each one once written.
        weights_only: only False: the trainer writes full checkpoints.
        tag: the tag sent with each request (the trainer adds it to its file name).
    """

    #: how long close() waits for answers to requests still in flight
    close_timeout: float = 2.0

    def __init__(
        self,
        folder: str | os.PathLike | None = None,
        filename: str | os.PathLike | None = None,
        latest_filename: str | os.PathLike | None = "latest",
        save_interval: Time | str | int | Callable[[Any, Event], bool] = "1ep",
        *,
        num_checkpoints_to_keep: int = -1,
        weights_only: bool = False,
        tag: str = "",
    ) -> None:
        if weights_only:
            raise ValueError("CheckpointSaver: weights_only=True is not supported: the trainer writes "
                             "full checkpoints (model, optimizers, schedulers, timestamp, RNG)")
        if isinstance(num_checkpoints_to_keep, bool) or not isinstance(num_checkpoints_to_keep, int) \
                or num_checkpoints_to_keep < -1:
            raise ValueError("CheckpointSaver: num_checkpoints_to_keep must be an int >= -1, "
                             f"got {num_checkpoints_to_keep!r}")
        self.folder = None if folder is None else str(folder)
        self.filename = None if filename is None else str(filename)
        self.latest_filename = None if latest_filename is None else str(latest_filename)
        for option, text, fields in (("folder", self.folder, _FOLDER_FIELDS),
                                     ("filename", self.filename, _NAME_FIELDS),
                                     ("latest_filename", self.latest_filename, _FOLDER_FIELDS)):
            _check_format(option, text, fields)
        self.save_interval = save_interval if callable(save_interval) else _Every(save_interval)
        self.num_checkpoints_to_keep = num_checkpoints_to_keep
        self.weights_only = False
        self.tag = str(tag)
        #: paths of the checkpoints kept, oldest first (at most num_checkpoints_to_keep)
        self.saved_checkpoints: list[str] = []
        #: where the trainer wrote a checkpoint -> where `folder` moved it (the worker keeps
        #: the callbacks' state beside it there: workers/callback_state.py)
        self.moved_checkpoints: dict[str, str] = {}
        #: every save this saver asked for, in order, with the trainer's answer
        self.saves: list[Save] = []
        self.last_checkpoint_batch: int | None = None
        self._run_name, self._rank = "", 0
        self._lock = threading.Lock()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender: threading.Thread | None = None
        self._notes: deque[str] = deque()

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (the trainer sends each callback to its worker process): no thread parts."""
        state = self.__dict__.copy()
        for name in ("_lock", "_inbox", "_sender"):
            del state[name]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock, self._inbox, self._sender = threading.Lock(), queue.SimpleQueue(), None

    def decides_on(self) -> dict[str, Any]:
        """The schedule, declared to the trainer: it waits at each checkpoint event the
        interval names, so every file holds the step Composer's saver would have saved. A
        callable or a sample/token interval is judged here only: its saves are asked for
        asynchronously and land at the batch after."""
        every = self.save_interval
        if isinstance(every, _Every) and every.interval.unit in (TimeUnit.EPOCH, TimeUnit.BATCH):
            return {every.event.value: every.interval}
        return {}

    # -------------------------------------------------------------- events

    def fit_start(self, state, logger) -> None:
        self._run_name, self._rank = state.run_name, state.rank
        if isinstance(self.save_interval, _Every):
            self.save_interval.start(state.timestamp)

    def batch_checkpoint(self, state, logger) -> None:
        self._maybe_save(state, logger, Event.BATCH_CHECKPOINT)

    def epoch_checkpoint(self, state, logger) -> None:
        self._maybe_save(state, logger, Event.EPOCH_CHECKPOINT)

    def iteration_checkpoint(self, state, logger) -> None:
        self._maybe_save(state, logger, Event.ITERATION_CHECKPOINT)

    def close(self, state, logger) -> None:
        if self._sender is not None:
            self._inbox.put(None)
            self._sender.join(self.close_timeout)
            unanswered = [s for s in self.saves if s.step is None and s.error is None]
            if self._sender.is_alive() and unanswered:
                self._notes.append(f"CheckpointSaver: {len(unanswered)} checkpoint request(s) had "
                                   "no answer when the worker closed")
        self._flush_notes(logger)

    def batch_end(self, state, logger) -> None:
        self._flush_notes(logger)

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for every request sent so far to be answered."""
        if self._sender is None or not self._sender.is_alive():
            return self._sender is None or all(s.step is not None or s.error for s in self.saves)
        done = threading.Event()
        self._inbox.put(done)
        return done.wait(timeout)

    # ------------------------------------------------------------- deciding

    def _maybe_save(self, state, logger, event: Event) -> None:
        self._flush_notes(logger)
        self._run_name, self._rank = state.run_name or self._run_name, state.rank
        if not self.save_interval(state, event) or self.last_checkpoint_batch == state.timestamp.batch:
            return
        self.last_checkpoint_batch = state.timestamp.batch
        ts = state.timestamp
        if state.max_duration is not None and state.max_duration.reached(ts) and not state.decision_awaited:
            logger.log_text(f"CheckpointSaver: not asking for a checkpoint at epoch {ts.epoch}, batch "
                            f"{ts.batch}: the run ends here, before the trainer reads requests again")
            return
        args: dict[str, Any] = {"tag": self.tag}
        if self.filename is not None:
            args["filename"] = _format(self.filename, state, ts)
        if self.control_handle is None:
            self._ask("checkpoint", args)  # raises NotAttachedError, which says what is missing
        save = Save(asked_at=ts)
        with self._lock:
            self.saves.append(save)
        if self._sender is None:
            self._sender = threading.Thread(target=self._send_all, name="offloop-CheckpointSaver",
                                            daemon=True)
            self._sender.start()
        self._inbox.put((save, args))
        if state.decision_awaited:
            # the trainer waits at this event: answered once it has taken the checkpoint (the
            # file holds this step); writing the file goes on beside training, and the ack
            # (rotation, `latest`) follows when it is durable
            save.taken.wait(self.control_timeout)

    # ------------------------------------------------- the sender thread

    def _send_all(self) -> None:
        while True:
            item = self._inbox.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            save, args = item
            try:
                ack = self._ask("checkpoint", args, on_taken=lambda _result, s=save: s.taken.set())
            except Exception as exc:
                save.taken.set()
                save.error = f"{type(exc).__name__}: {exc}"
                self._notes.append(f"CheckpointSaver: the checkpoint asked for at batch "
                                   f"{save.asked_at.batch} failed: {save.error}")
                continue
            save.taken.set()  # answered without a note (a refusal, an older trainer)
            if not ack.ok:
                save.error = ack.error or "refused"
                self._notes.append(f"CheckpointSaver: the trainer refused the checkpoint asked for "
                                   f"at batch {save.asked_at.batch}: {save.error}")
                continue
            try:
                self._keep(save, ack.result)
            except OSError as exc:
                save.error = f"{type(exc).__name__}: {exc}"
                self._notes.append(f"CheckpointSaver: the trainer saved {ack.result.get('path')}, "
                                   f"but it could not be kept: {exc}")

    def _keep(self, save: Save, result: dict[str, Any]) -> None:
        """Move (if asked), rotate, and point `latest` at the newest; on this thread only."""
        path = Path(result["path"])
        save.step, save.path = result.get("step"), str(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path} is not on this worker's file system (is the trainer on "
                                    "another host?): not moving, rotating or linking it")
        if self.folder is not None:
            folder = Path(self.folder.format(run_name=self._run_name, rank=self._rank))
            if path.parent.resolve() != folder.resolve():
                folder.mkdir(parents=True, exist_ok=True)
                written = str(path)
                path = Path(shutil.move(written, str(folder / path.name)))
                self.moved_checkpoints[written] = str(path)
                for state in Path(written).parent.glob(f"{glob.escape(path.name)}.callbacks-*.json"):
                    shutil.move(str(state), str(folder / state.name))  # callbacks' state goes with it
        save.path = str(path)
        with self._lock:
            if save.path in self.saved_checkpoints:
                self.saved_checkpoints.remove(save.path)
            self.saved_checkpoints.append(save.path)
            doomed = []
            while self.num_checkpoints_to_keep >= 0 and len(self.saved_checkpoints) > self.num_checkpoints_to_keep:
                doomed.append(self.saved_checkpoints.pop(0))
        for old in doomed:
            Path(old).unlink(missing_ok=True)
            for state in Path(old).parent.glob(f"{glob.escape(Path(old).name)}.callbacks-*.json"):
                state.unlink(missing_ok=True)
        if self.latest_filename is not None and self.num_checkpoints_to_keep != 0:
            link = path.parent / self.latest_filename.format(run_name=self._run_name, rank=self._rank)
            _point(link, path)
        self._notes.append(f"CheckpointSaver: saved {path} at batch {save.step} "
                           f"(asked at batch {save.asked_at.batch})")

    def _flush_notes(self, logger) -> None:
        while self._notes:
            logger.log_text(self._notes.popleft())


def _point(link: Path, target: Path) -> None:
    """Make `link` a relative symlink to `target`, replacing any old one atomically."""
    link.parent.mkdir(parents=True, exist_ok=True)
    tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    os.symlink(os.path.relpath(target, link.parent), tmp)
    os.replace(tmp, link)


def _check_format(option: str, text: str | None, fields: dict[str, Any]) -> None:
    if text is None:
        return
    try:
        text.format(**fields)
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"CheckpointSaver: {option} {text!r} is not a valid format string "
                         f"({exc!r}); its fields are {', '.join('{' + k + '}' for k in fields)}") from None


def _format(text: str, state, ts: Timestamp) -> str:
    return text.format(run_name=state.run_name, rank=state.rank, epoch=ts.epoch, batch=ts.batch,
                       sample=ts.sample, token=ts.token)
