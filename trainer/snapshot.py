"""Publishing snapshots from the training thread without host-device synchronisation.

Events are held by the publisher and leave in bursts: at each batch's control poll
(and after each eval and predict batch) the trainer sends what is held if the last
burst left at least `burst_interval` ago (5 ms by default), and it sends at once
wherever it may pause (eval end, a checkpoint, fit end). Each burst wakes the
publisher's proxy, which costs the training thread a cross-CPU signal (about 14 µs on
a virtual machine): a step slower than the interval sends its own events at its end;
faster steps share one wake-up.

On the CPU a snapshot is published at once (0-d tensors become floats; on the CPU
that is no sync). On CUDA, tensors are copied into pinned host memory with
`non_blocking=True`, a CUDA event is recorded behind the copies, and the snapshot is
published once `event.query()` says the copies are done; snapshots leave in the
order they were made, so the stream stays FIFO. Nothing here calls `.item()`,
`.cpu()` or `float()` on a CUDA tensor.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

import torch

from offloop.bus import WireError

__all__ = ["Emitter"]

log = logging.getLogger("offloop.trainer")


class Emitter:
    """The trainer's one way to publish: `emit(topic, ts, data)`."""

    def __init__(self, publisher, device: torch.device, burst_interval: float = 0.0) -> None:
        self.publisher = publisher
        self.cuda = device.type == "cuda"
        self._waiting: deque[tuple[str, tuple, dict, Any]] = deque()
        self.wants = publisher.wants if publisher is not None else frozenset().__contains__
        self._refused = 0  # publish() raised (a reserved topic, or nothing held)
        if publisher is not None:
            publisher.hold(burst_interval)
            if not self.cuda:
                # Nothing is ever staged on the CPU: emit() is the publisher's own publish(),
                # which skips a topic nobody wants. Holding, it never raises for the trainer's
                # topics: a value the wire cannot carry is counted when the burst is encoded.
                self.emit = self.snapshot = publisher.publish
        self.release_due = publisher.release_due if publisher is not None else _nothing

    @property
    def unencodable(self) -> int:
        """Snapshots that could not be published (a value the wire cannot carry): counted
        and logged, never raised into the training loop."""
        return self._refused + (self.publisher.unencodable if self.publisher is not None else 0)

    def release(self) -> None:
        """Send the held events now: wherever the loop may pause (release_due() is the
        per-batch call: it sends once the burst interval has passed)."""
        if self.publisher is not None:
            self.publisher.release()

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
            self._publish(topic, ts, data)

    def snapshot(self, topic: str, ts: tuple, data: dict) -> None:
        """Publish a snapshot the trainer built with `host()`: host numbers on the CPU
        (published as they are), device tensors on CUDA (staged, as emit_tensors)."""
        self.emit_tensors(topic, ts, data)

    def host(self, tensor: torch.Tensor) -> Any:
        """What a snapshot holds for a tensor: on the CPU a number now (a 0-d tensor; no
        device to wait for) or the tensor detached; on CUDA the tensor, staged later."""
        if not self.cuda and tensor.ndim == 0:
            return tensor.item()
        return tensor.detach()

    def _publish(self, topic: str, ts: tuple, data: dict | None) -> None:
        try:
            self.publisher.publish(topic, ts, data)
        except WireError as exc:
            self._refuse(topic, exc)

    def _refuse(self, topic: str, exc: WireError) -> None:
        self._refused += 1
        if self._refused == 1 or self._refused % 1000 == 0:
            log.warning("offloop: %s snapshot not published (%d so far): %s; training goes on",
                        topic, self._refused, exc)

    def emit_tensors(self, topic: str, ts: tuple, data: dict) -> None:
        """Publish a snapshot holding tensors: now on the CPU (0-d ones as numbers), or
        once its tensors have left the GPU."""
        publisher = self.publisher
        if publisher is None or topic not in publisher._wanted:
            return
        if self.cuda:
            self._emit_staged(topic, ts, data)
        else:
            self._publish(topic, ts, _host_values(data))

    def _emit_staged(self, topic: str, ts: tuple, data: dict) -> None:
        staged, copied = _stage(data)
        if copied:
            ready = torch.cuda.Event()
            ready.record()
            self._waiting.append((topic, ts, staged, ready))
        elif self._waiting:
            self._waiting.append((topic, ts, staged, None))  # keep the stream in order
        else:
            self._publish(topic, ts, staged)
        self.poll()

    def poll(self) -> None:
        """Publish every staged snapshot whose copies have finished, oldest first."""
        waiting = self._waiting
        while waiting:
            topic, ts, staged, ready = waiting[0]
            if ready is not None and not ready.query():
                return
            waiting.popleft()
            self._publish(topic, ts, _host_values(staged))

    def flush(self) -> None:
        """Wait for every staged copy, publish it and release everything held: only where
        the loop may block (fit end, eval() and predict() end, close), never per batch."""
        if self._waiting:
            for *_, ready in self._waiting:
                if ready is not None:
                    ready.synchronize()
            self.poll()
        self.release()


def _nothing() -> None:
    pass


def _stage(data: Any) -> tuple[Any, bool]:
    """Start non-blocking copies of CUDA tensors (in dicts, lists and tuples, at any depth)
    into pinned memory."""
    if isinstance(data, torch.Tensor):
        return (_to_pinned(data), True) if data.is_cuda else (data, False)
    if isinstance(data, dict):
        staged = {key: _stage(value) for key, value in data.items()}
        return {key: value for key, (value, _) in staged.items()}, any(c for _, c in staged.values())
    if isinstance(data, (list, tuple)):
        staged = [_stage(value) for value in data]
        return [value for value, _ in staged], any(c for _, c in staged)
    return data, False


def _to_pinned(tensor: torch.Tensor) -> torch.Tensor:
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor.detach(), non_blocking=True)
    return host


def _host_values(data: dict) -> dict:
    """0-d host tensors become Python numbers (in dicts, lists and tuples, at any depth);
    larger host tensors travel as frames."""
    return {key: _host_value(value) for key, value in data.items()}


def _host_value(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.ndim == 0 else value.detach()
    if isinstance(value, dict):
        return _host_values(value)
    if isinstance(value, (list, tuple)):
        return [_host_value(item) for item in value]
    return value
