"""Publishing snapshots from the training thread without host-device synchronisation.

On the CPU a snapshot is published at once (0-d tensors become floats; on the CPU
that is no sync). On CUDA, tensors are copied into pinned host memory with
`non_blocking=True`, a CUDA event is recorded behind the copies, and the snapshot is
published once `event.query()` says the copies are done; snapshots leave in the
order they were made, so the stream stays FIFO. Nothing here calls `.item()`,
`.cpu()` or `float()` on a CUDA tensor.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

__all__ = ["Emitter"]


class Emitter:
    """The trainer's one way to publish: `emit(topic, ts, data)`."""

    def __init__(self, publisher, device: torch.device) -> None:
        self.publisher = publisher
        self.cuda = device.type == "cuda"
        self._waiting: deque[tuple[str, tuple, dict, Any]] = deque()
        self.wants = publisher.wants if publisher is not None else (lambda topic: False)

    def emit(self, topic: str, ts: tuple, data: dict | None = None) -> None:
        """Publish a snapshot of plain values (no tensors): the hot path, kept to one
        membership test when nobody wants the topic."""
        publisher = self.publisher
        if publisher is None or topic not in publisher._wanted:
            return
        if self._waiting:
            self._waiting.append((topic, ts, data or {}, None))  # behind staged snapshots
            self.poll()
        else:
            publisher.publish(topic, ts, data)

    def emit_tensors(self, topic: str, ts: tuple, data: dict) -> None:
        """Publish a snapshot holding tensors: now on the CPU (0-d ones as numbers), or
        once its tensors have left the GPU."""
        publisher = self.publisher
        if publisher is None or topic not in publisher._wanted:
            return
        if self.cuda:
            self._emit_staged(topic, ts, data)
        else:
            publisher.publish(topic, ts, _host_values(data))

    def _emit_staged(self, topic: str, ts: tuple, data: dict) -> None:
        staged, copied = _stage(data)
        if copied:
            ready = torch.cuda.Event()
            ready.record()
            self._waiting.append((topic, ts, staged, ready))
        elif self._waiting:
            self._waiting.append((topic, ts, staged, None))  # keep the stream in order
        else:
            self.publisher.publish(topic, ts, staged)
        self.poll()

    def poll(self) -> None:
        """Publish every staged snapshot whose copies have finished, oldest first."""
        waiting = self._waiting
        while waiting:
            topic, ts, staged, ready = waiting[0]
            if ready is not None and not ready.query():
                return
            waiting.popleft()
            self.publisher.publish(topic, ts, _host_values(staged))

    def flush(self) -> None:
        """Wait for every staged copy and publish it: only where the loop may block
        (fit end, close), never per batch."""
        if self._waiting:
            for *_, ready in self._waiting:
                if ready is not None:
                    ready.synchronize()
            self.poll()


def _stage(data: dict) -> tuple[dict, bool]:
    """Start non-blocking copies of CUDA tensors (one level of nesting) into pinned memory."""
    out: dict = {}
    copied = False
    for key, value in data.items():
        if isinstance(value, torch.Tensor) and value.is_cuda:
            out[key] = _to_pinned(value)
            copied = True
        elif isinstance(value, dict):
            inner, inner_copied = _stage(value)
            out[key] = inner
            copied = copied or inner_copied
        else:
            out[key] = value
    return out, copied


def _to_pinned(tensor: torch.Tensor) -> torch.Tensor:
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor.detach(), non_blocking=True)
    return host


def _host_values(data: dict) -> dict:
    """0-d host tensors become Python numbers; larger host tensors travel as frames."""
    out = {}
    for key, value in data.items():
        if isinstance(value, torch.Tensor):
            out[key] = value.item() if value.ndim == 0 else value.detach()
        elif isinstance(value, dict):
            out[key] = _host_values(value)
        else:
            out[key] = value
    return out
