"""Checkpoints: named, written atomically (temporary file, fsync, rename), read with weights_only.

A checkpoint holds everything `load_path=` needs to resume exactly: model, optimizers,
schedulers, timestamp, RNG states, and the dataloader position (the RNG state the
epoch's iterator was created from, and how many batches of the epoch are done).
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from offloop.bus import ControlRequest, Timestamp
from offloop.bus.discovery import fsync_folder, remove_stale_temporaries
from offloop.trainer.checkpoint_writer import BackgroundWriter, HostCopy, Write
from offloop.trainer.errors import CheckpointError

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "rng_state",
    "set_rng_state",
    "seed_everything",
    "FORMAT",
    "Parts",
    "Checkpointer",
    "HostCheckpointer",
    "epoch_iterator",
    "requested_name",
    "step_name",
    "unused_name",
    "check_filename",
]

log = logging.getLogger("offloop.trainer")

FORMAT = "offloop-checkpoint-1"


def rng_state() -> dict[str, Any]:
    """Every RNG a training step may draw from, as plain lists and tensors."""
    version, state, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": [s for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
        "python": [version, list(state), gauss],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
    }


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    version, values, gauss = state["python"]
    random.setstate((version, tuple(values), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


def epoch_iterator(
    loader: Iterable, epoch_rng: dict | None, skip: int, epoch: int
) -> tuple[Iterator, dict[str, Any]]:
    """An iterator over epoch `epoch` of `loader`, and the RNG state its order was drawn
    from (a DistributedSampler is told the epoch first). Resuming (`skip` batches of the
    epoch done), the order is drawn again from the saved `epoch_rng` and the done batches
    are skipped; the other RNGs go on as they were."""
    sampler = getattr(loader, "sampler", None)
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
    resume_rng = rng_state() if skip and epoch_rng is not None else None
    if resume_rng is not None:
        set_rng_state(epoch_rng)
    drawn_from = rng_state()
    iterator = iter(loader)
    for _ in range(skip):
        next(iterator)
    if resume_rng is not None:
        set_rng_state(resume_rng)
    return iterator, drawn_from


def save_checkpoint(path: str | os.PathLike, payload: dict[str, Any]) -> Path:
    """Write `payload` to `path` atomically; on any failure no partial file is left."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # the writer's pid in the name: one a killed writer left is known (remove_stale_temporaries)
        fd, tmp = tempfile.mkstemp(
            prefix=f".{path.name}.pid{os.getpid()}.", suffix=".tmp", dir=path.parent
        )
    except OSError as exc:
        raise CheckpointError(
            f"cannot write a checkpoint in {path.parent}: {exc.strerror or exc}"
        ) from None
    try:
        with os.fdopen(fd, "wb") as out:
            torch.save(payload, out)
            out.flush()
            os.fsync(out.fileno())
        _publish(Path(tmp), path)
        fsync_folder(path.parent)  # the new name itself survives a power cut
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, CheckpointError):  # the name is taken: said as it is
            raise
        # torch.save reports a failed write (disk full: EFBIG, ENOSPC) as a RuntimeError
        # raised while handling the OSError; find the OSError to refuse cleanly.
        cause = _os_error(exc) if isinstance(exc, Exception) else None  # not KeyboardInterrupt
        if cause is not None:
            raise CheckpointError(
                f"cannot write checkpoint {path}: {cause.strerror or cause}"
            ) from None
        raise
    return path


def _publish(tmp: Path, path: Path) -> None:
    """Give the written file its final name at once, never over an existing file: a hard
    link fails where the name is taken (os.replace would overwrite); a file system without
    hard links gets a check, then the rename."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise CheckpointError(
            f"checkpoint {path} exists: a checkpoint is never written over"
        ) from None
    except OSError:  # no hard links here (EPERM, ENOTSUP, EXDEV ...)
        if path.exists():
            raise CheckpointError(
                f"checkpoint {path} exists: a checkpoint is never written over"
            ) from None
        os.replace(tmp, path)
        return
    tmp.unlink()


def _os_error(exc: BaseException | None) -> OSError | None:
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, OSError):
            return exc
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"load_path {str(path)!r} does not exist or is not a file")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(
            f"load_path {str(path)!r} is not a readable offloop checkpoint: {exc}"
        ) from None


# ------------------------------------------------------------- the trainer's checkpoints


class Parts:
    """What a checkpoint saves and restores of a training run (the model unwrapped from DDP)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizers: list,
        schedulers: list,
        scaler: Any,
        algorithms: Sequence = (),
    ) -> None:
        self.model, self.optimizers, self.schedulers, self.scaler = (
            model,
            optimizers,
            schedulers,
            scaler,
        )
        self.algorithms = list(algorithms)  # each one's state_dict() travels with the checkpoint


class Checkpointer:
    """Writes the run's checkpoints into `folder` (rank 0 writes; every rank takes part)
    and restores one; `written` lists every file written, in order. It keeps the data
    order's place too: the RNG state each epoch's order is drawn from (`epoch_batches()`)
    and, after `restore()`, the batches of that epoch already trained."""

    writes_in_loop = True  # Control takes requested checkpoints through it as they come
    writes_for_all_ranks = True  # rank 0 writes the file; the other ranks take part only

    def __init__(
        self, parts: Parts, agreement, folder: Path, *, rank: int, seed: int, run_name: str
    ) -> None:
        self.parts, self.agreement, self.folder = parts, agreement, folder
        self.rank, self.seed, self.run_name = rank, seed, run_name
        self.written: list[str] = []  # durable, in order
        self.writer = BackgroundWriter()
        self._host = HostCopy()  # the host buffers each checkpoint's state is copied into
        self.epoch_rng: dict | None = None  # the RNG state this epoch's data order is drawn from
        self._resume_batches = 0  # batches of the restored epoch already trained
        if rank == 0:
            for name in remove_stale_temporaries(folder):
                log.warning(
                    "offloop: removed %s in %s, left by a checkpoint write that was killed",
                    name,
                    folder,
                )

    def epoch_batches(self, loader: Iterable, epoch: int) -> Iterator:
        """An iterator over epoch `epoch` of `loader` (the first after restore() skips the
        batches already trained); its order's RNG state is kept for the checkpoints."""
        iterator, self.epoch_rng = epoch_iterator(
            loader, self.epoch_rng, self._resume_batches, epoch
        )
        self._resume_batches = 0
        return iterator

    def take_requested(
        self, ts: Timestamp, requests: list[ControlRequest]
    ) -> tuple[Path, str, Write | None]:
        """A checkpoint of step `ts` named as `requests` ask (requested_name()), taken now."""
        return self.take(ts, *requested_name(requests))

    def write(self, ts: Timestamp, tag: str, filename: str | None) -> tuple[Path, str]:
        """take() and wait until the file is durable: (the file, its tag)."""
        path, tag, write = self.take(ts, tag, filename)
        if write is not None:
            self.durable(write)
        return path, tag

    def take(self, ts: Timestamp, tag: str, filename: str | None) -> tuple[Path, str, Write | None]:
        """Take a checkpoint of step `ts`: its state copied to host memory now, written in
        the background (checkpoint_writer.py). The file, the tag rank 0 gave it (under
        torchrun the other ranks hold no request and learn both from rank 0), and rank 0's
        Write (None on the other ranks: they write nothing). A write still in flight is
        waited for first: one at a time (the caller answers it before, Control.take)."""
        self.writer.wait()
        name = filename or step_name(ts, tag)
        taken = ""  # why rank 0 cannot use the name: a file of that name exists
        if self.rank == 0:
            name, taken = unused_name(self.folder, name, explicit=filename is not None)
        # one collective on every rank (never inside `if rank == 0`); rank 0's name wins, and
        # every rank judges it after the gather, so all refuse a bad one alike
        states = self.agreement.gather((name, tag, rng_state(), self.epoch_rng, taken))
        name, tag, taken = states[0][0], states[0][1], states[0][4]
        check_filename(name)
        if taken:
            raise CheckpointError(taken)
        path = self.folder / name
        if self.rank != 0:
            return path, tag, None
        parts = self.parts
        payload, ready = self._host.copy({
            "format": FORMAT,
            "model": parts.model.state_dict(),
            "optimizers": [o.state_dict() for o in parts.optimizers],
            "schedulers": [s.state_dict() for s in parts.schedulers],
            "scaler": parts.scaler.state_dict() if parts.scaler is not None else None,
            "algorithms": [
                a.state_dict() if hasattr(a, "state_dict") else {} for a in parts.algorithms
            ],
            "timestamp": ts.state_dict(),
            "rng": [state[2] for state in states],  # every rank's, by rank
            "epoch_rng": [state[3] for state in states],
            "seed": self.seed,
            "run_name": self.run_name,
        })
        return path, tag, self.writer.submit(path, payload, ready, save_checkpoint)

    def durable(self, write: Write) -> Path:
        """Wait until `write` is on disk (raises its CheckpointError) and list it as written."""
        path = write.result()
        self.written.append(str(path))
        return path

    def restore(self, path: str | os.PathLike) -> Timestamp:
        """Load a checkpoint into the parts, this rank's RNGs and the data order's place
        (the next epoch_batches() resumes where it stopped); its Timestamp."""
        parts, state = self.parts, load_checkpoint(path)
        if state.get("format") != FORMAT:
            raise CheckpointError(f"load_path {str(path)!r} is not an offloop checkpoint")
        parts.model.load_state_dict(state["model"])
        if len(state["optimizers"]) != len(parts.optimizers):
            raise CheckpointError(
                f"checkpoint has {len(state['optimizers'])} optimizers, "
                f"this trainer {len(parts.optimizers)}"
            )
        for opt, opt_state in zip(parts.optimizers, state["optimizers"], strict=True):
            opt.load_state_dict(opt_state)
        for sched, sched_state in zip(parts.schedulers, state["schedulers"], strict=False):
            sched.load_state_dict(sched_state)
        if parts.scaler is not None and state.get("scaler"):
            parts.scaler.load_state_dict(state["scaler"])
        _restore_algorithms(parts.algorithms, state.get("algorithms") or [], path)
        rank = min(self.rank, len(state["rng"]) - 1)
        set_rng_state(state["rng"][rank])
        ts = Timestamp.from_state_dict(state["timestamp"])
        self.epoch_rng, self._resume_batches = state["epoch_rng"][rank], ts.batch_in_epoch
        return ts


class HostCheckpointer:
    """Requested checkpoints written by a host trainer (hooked_run.py): `save(path)` writes
    its checkpoint at `path` on every rank and returns the path written; None for a trainer
    that saves later itself (its integration takes the agreed requests and answers them).
    Names as the Trainer's Checkpointer gives them: never written over, rank 0's on every rank."""

    def __init__(self, save, agreement, folder: Path, *, rank: int, suffix: str) -> None:
        self.save, self.agreement, self.folder = save, agreement, folder
        self.rank, self.suffix = rank, suffix
        self.writes_in_loop = save is not None
        self.writes_for_all_ranks = False  # every rank saves its own before take_requested returns
        self.written: list[str] = []

    def take_requested(
        self, ts: Timestamp, requests: list[ControlRequest]
    ) -> tuple[Path, str, None]:
        """Written before it returns (the host trainer's own save): no Write to wait for."""
        if self.save is None:  # only after the fit (answer_late): the host trainer no longer saves
            raise CheckpointError("the run has finished: this trainer saves only while it trains")
        tag, filename = requested_name(requests)
        name = filename or step_name(ts, tag, self.suffix)
        taken = ""
        if self.rank == 0:
            name, taken = unused_name(self.folder, name, explicit=filename is not None)
        if self.agreement.active:
            name, tag, taken = self.agreement.gather((name, tag, taken))[0]
        check_filename(name)
        if taken:
            raise CheckpointError(taken)
        try:
            path = self.save(self.folder / name)
        except Exception as exc:  # a full disk, a refused path: refused, training goes on
            raise CheckpointError(f"checkpoint {name} could not be written: {exc}") from exc
        self.written.append(str(path))
        return Path(path), tag, None


def _restore_algorithms(algorithms: list, states: list, path: str | os.PathLike) -> None:
    """Each algorithm's state, in order. A checkpoint written without algorithms starts
    them afresh (an EMA added on resume averages from the loaded weights)."""
    if not states:
        if algorithms:
            log.warning(
                "offloop: checkpoint %s holds no algorithm state: %s start afresh",
                path,
                ", ".join(type(a).__name__ for a in algorithms),
            )
        return
    if len(states) != len(algorithms):
        raise CheckpointError(
            f"checkpoint {str(path)!r} holds the state of {len(states)} algorithms, this "
            f"trainer has {len(algorithms)}: pass the same algorithms, in the same order"
        )
    for algorithm, algorithm_state in zip(algorithms, states, strict=True):
        if hasattr(algorithm, "load_state_dict"):
            algorithm.load_state_dict(algorithm_state)


def step_name(ts: Timestamp, tag: str, suffix: str = ".pt") -> str:
    """The name a checkpoint of step `ts` gets when its request names no file."""
    return f"ep{ts.epoch}-ba{ts.batch}" + (f"-{tag}" if tag else "") + suffix


def unused_name(folder: Path, name: str, explicit: bool) -> tuple[str, str]:
    """(the name to write, why it cannot be written or ""): a checkpoint is never written
    over. A name the trainer made gets the first free `-2`, `-3`, … before its suffix (two
    saves at one step); a file name a client asked for that exists is refused."""
    if not (folder / name).exists():
        return name, ""
    if explicit:
        return name, (
            f"checkpoint {folder / name} exists: a checkpoint is never written over "
            "(ask for another filename)"
        )
    stem, dot, suffix = name.rpartition(".")
    stem, suffix = (stem, dot + suffix) if dot else (name, "")
    return next(
        f"{stem}-{n}{suffix}"
        for n in itertools.count(2)
        if not (folder / f"{stem}-{n}{suffix}").exists()
    ), ""


def requested_name(requests: Sequence[ControlRequest]) -> tuple[str, str | None]:
    """(tag, file name) for the checkpoint that answers `requests` (one request, as
    Control.take_due groups them): its tag, and its file name if it asked for one. With no
    request (a SIGTERM asked, or under torchrun rank 0 holds the requests) the tag is
    'sigterm'; rank 0's name is used."""
    tags = [safe_name(str(r.args.get("tag", ""))) for r in requests] or ["sigterm"]
    filename = next((str(r.args["filename"]) for r in requests if r.args.get("filename")), None)
    return "-".join(t for t in tags if t), filename


def safe_name(text: str) -> str:
    """A tag or file name reduced to characters that cannot leave the checkpoint folder."""
    cleaned = "".join(c if c.isalnum() or c in "._-" else "_" for c in text)[:100]
    return cleaned.lstrip(".")


def check_filename(name: Any) -> None:
    """A checkpoint file name must stay in the save folder: letters, digits, '.', '-', '_'."""
    if name is not None and (not isinstance(name, str) or not name or safe_name(name) != name):
        raise CheckpointError(
            f"checkpoint filename {name!r} must be a plain file name "
            "(letters, digits, '.', '-', '_')"
        )
