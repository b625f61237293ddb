"""Checkpoints off the training loop: the training thread copies the state into host
buffers it reuses (on CUDA: pinned, copied without blocking, one event recorded after the
copies); a writer thread waits for that event, then serialises, writes, fsyncs and renames.

Promise: at most one checkpoint is being written at a time (the next copy would overwrite
the buffers the writer reads: `BackgroundWriter.submit` refuses while a write is in
flight, and the Checkpointer waits for it first), a write is durable or has failed when
its `Write` says done, and the file is never seen under its name before it is whole
(save_checkpoint()'s temporary file, fsync, rename). The buffers stay allocated between
checkpoints: as much host memory as the state it copies.
"""

from __future__ import annotations

import copy
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from offloop.trainer.errors import CheckpointError

__all__ = ["HostCopy", "Write", "BackgroundWriter"]


class HostCopy:
    """Copies a checkpoint's payload into host memory that outlives the step: every tensor
    into a buffer kept from the last copy (same place in the payload, same shape and
    dtype), everything else deep-copied. Reused buffers cost no allocation nor page faults
    after the first checkpoint; on CUDA they are pinned, so the copies run without blocking
    the training thread and the writer waits for `event` instead."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}

    def copy(self, payload: Any) -> tuple[Any, torch.cuda.Event | None]:
        """The payload with host tensors the training loop no longer touches, and the CUDA
        event to wait for before reading them (None when nothing came from a GPU)."""
        seen: dict[tuple, torch.Tensor] = {}  # tensors sharing memory (tied weights) share a copy
        on_gpu = [False]
        out = self._walk(payload, (), seen, on_gpu)
        event = None
        if on_gpu[0]:
            event = torch.cuda.Event()
            event.record()
        return out, event

    def _walk(self, value: Any, place: tuple, seen: dict, on_gpu: list) -> Any:
        if isinstance(value, torch.Tensor):
            return self._tensor(value, place, seen, on_gpu)
        if isinstance(value, dict):  # a state_dict's OrderedDict stays one; other kinds: dict
            kind = type(value) if type(value) in (dict, OrderedDict) else dict
            return kind((k, self._walk(v, (*place, k), seen, on_gpu)) for k, v in value.items())
        if type(value) in (list, tuple):
            return type(value)(
                self._walk(v, (*place, i), seen, on_gpu) for i, v in enumerate(value))
        return copy.deepcopy(value)

    def _tensor(self, tensor: torch.Tensor, place: tuple, seen: dict, on_gpu: list) -> torch.Tensor:
        tensor = tensor.detach()
        if tensor.layout is not torch.strided:  # sparse and the like: a plain copy
            return tensor.to("cpu", copy=True)
        same = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
                tensor.stride(), tensor.dtype, tensor.device)
        if same in seen:
            return seen[same]
        gpu = tensor.device.type == "cuda"
        buffer = self._buffers.get(place)
        if (buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype
                or buffer.is_pinned() != gpu):
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=gpu)
            self._buffers[place] = buffer
        buffer.copy_(tensor, non_blocking=gpu)
        on_gpu[0] = on_gpu[0] or gpu
        seen[same] = buffer
        return buffer


class Write:
    """One checkpoint being written: `done()` without waiting, `result()` waits and gives
    the path, or raises the CheckpointError that stopped it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._finished = threading.Event()
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._finished.is_set()

    def wait(self) -> None:
        """Until the file is durable or the write has failed."""
        self._finished.wait()

    def result(self) -> Path:
        self._finished.wait()
        if self._error is not None:
            raise self._error
        return self.path

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        self._finished.set()


class BackgroundWriter:
    """The writer thread: `submit(path, payload, event, save)` returns at once; `save`
    (checkpoint.save_checkpoint) runs on the thread once `event` (if any) has completed.
    One write at a time: submitting while one is in flight is a bug of the caller's, said
    as such. The thread is a daemon started on the first write; the trainer waits for each
    write where it must be durable (fit's end, close, a direct save_checkpoint())."""

    def __init__(self) -> None:
        self.current: Write | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    @property
    def busy(self) -> bool:
        return self.current is not None and not self.current.done()

    def submit(self, path: Path, payload: Any, event, save: Callable[[Path, Any], Any]) -> Write:
        if self.busy:
            raise RuntimeError("a checkpoint is already being written: wait for it first")
        write = self.current = Write(path)
        self._queue.put((write, payload, event, save))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="offloop-checkpoint-writer",
                                            daemon=True)
            self._thread.start()
        return write

    def wait(self) -> None:
        """Until the write in flight (if any) is durable or has failed."""
        if self.current is not None:
            self.current.wait()

    def _run(self) -> None:
        while True:
            write, payload, event, save = self._queue.get()
            try:
                if event is not None:
                    event.synchronize()  # the one wait for the GPU: its copies into our buffers
                save(write.path, payload)
            except CheckpointError as exc:
                write._finish(exc)
            except BaseException as exc:  # noqa: BLE001 - said to the trainer as a refusal
                write._finish(CheckpointError(
                    f"checkpoint {write.path} could not be written: {type(exc).__name__}: {exc}"))
            else:
                write._finish(None)
