"""Checkpoints: written atomically (temporary file, fsync, rename), read with weights_only.

A checkpoint holds everything `load_path=` needs to resume exactly: model, optimizers,
schedulers, timestamp, RNG states, and the dataloader position (the RNG state the
epoch's iterator was created from, and how many batches of the epoch are done).
"""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from offloop.trainer.errors import CheckpointError

__all__ = ["save_checkpoint", "load_checkpoint", "rng_state", "set_rng_state"]


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


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    version, values, gauss = state["python"]
    random.setstate((version, tuple(values), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


def save_checkpoint(path: str | os.PathLike, payload: dict[str, Any]) -> Path:
    """Write `payload` to `path` atomically; on any failure no partial file is left."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise CheckpointError(f"cannot write a checkpoint in {path.parent}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "wb") as out:
            torch.save(payload, out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        # torch.save reports a failed write (disk full: EFBIG, ENOSPC) as a RuntimeError
        # raised while handling the OSError; find the OSError to refuse cleanly.
        cause = _os_error(exc) if isinstance(exc, Exception) else None  # not KeyboardInterrupt
        if cause is not None:
            raise CheckpointError(f"cannot write checkpoint {path}: {cause.strerror or cause}") from None
        raise
    return path


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
        raise CheckpointError(f"load_path {str(path)!r} is not a readable offloop checkpoint: {exc}") from None
