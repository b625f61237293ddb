"""The Emitter: the training thread's way to publish snapshots, in bursts (docs/trainer.md).
Promise: it never synchronises the GPU (CUDA tensors reach the host through pinned,
non-blocking copies) and snapshots leave in the order they were made."""

from __future__ import annotations

import logging
import weakref
from collections import deque
from collections.abc import Callable, Container
from typing import Any

import torch

from offloop.bus import Publisher, WireError

__all__ = ["Emitter"]

log = logging.getLogger("offloop.trainer")


class Emitter:
    """The trainer's one way to publish.

    `emit(topic, ts, data=None)` publishes plain values (no tensors); `snapshot(topic, ts,
    data)` publishes values built with `host()`; `release_due()` sends what is held once
    the burst interval has passed. These three are callables chosen once, here, not
    methods: where nothing can be staged ahead of an event (the CPU) `emit` and `snapshot`
    are the publisher's `held_publish()` (a membership test, then a clock read and an
    append, or a False) and `release_due` its own, so an event costs the loop one frame,
    the publisher's (benchmarks/trainer_overhead.py, `floor_bus_on_mean`); on CUDA they keep the
    stream in order behind snapshots still copying off the GPU; with no publisher they
    do nothing.
    """

    emit: Callable[..., Any]
    snapshot: Callable[..., Any]
    release_due: Callable[[], Any]

    def __init__(self, publisher: Publisher | None, device: torch.device, burst_interval: float = 0.0) -> None:
        self.publisher = publisher
        self.cuda = device.type == "cuda"
        self._waiting: deque[tuple[str, tuple, dict, Any]] = deque()
        self._stager = _Stager()
        # the loop builds a snapshot only where `wants(topic)`; `_published` is what the publisher takes
        self.wants = self._published = publisher.wants if publisher is not None else frozenset().__contains__
        self._refused = 0  # publish() raised (a reserved topic, or nothing held)
        if publisher is None:
            self.emit = self.snapshot = _nothing
            self.release_due = _nothing
            return
        publisher.hold(burst_interval)
        self.release_due = publisher.release_due
        if self.cuda:
            self.emit, self.snapshot = self._emit_in_order, self.emit_tensors
        else:
            # holding, publishing never raises for the trainer's topics: a value the wire
            # cannot carry is counted when the burst is encoded
            self.emit = self.snapshot = publisher.held_publish()

    def run_first(self, run: Callable[[str, dict | None], Any], topics: Container[str]) -> None:
        """Call `run(topic, data)` at each event before it is published: the algorithms
        (trainer/algorithms/). The loop then builds the snapshot of every event in `topics`
        (they run whether or not a worker wants it), and only the publisher's topics leave."""
        emit, snapshot, emit_tensors, published = self.emit, self.snapshot, self.emit_tensors, self._published

        def emit_after(topic: str, ts: tuple, data: dict | None = None) -> None:
            run(topic, data)
            emit(topic, ts, data)

        def snapshot_after(topic: str, ts: tuple, data: dict) -> None:
            run(topic, data)
            if published(topic):
                snapshot(topic, ts, data)

        def tensors_after(topic: str, ts: tuple, data: dict) -> None:
            run(topic, data)
            emit_tensors(topic, ts, data)

        self.emit, self.snapshot, self.emit_tensors = emit_after, snapshot_after, tensors_after
        self.wants = lambda topic: topic in topics or published(topic)

    @property
    def unencodable(self) -> int:
        """Snapshots that could not be published (a value the wire cannot carry): counted
        and logged, never raised into the training loop."""
        return self._refused + (self.publisher.stats.unencodable if self.publisher is not None else 0)

    def release(self) -> None:
        """Send the held events now: wherever the loop may pause (release_due() is the
        per-batch call: it sends once the burst interval has passed)."""
        if self.publisher is not None:
            self.publisher.release()

    def _emit_in_order(self, topic: str, ts: tuple, data: dict | None = None) -> None:
        """`emit` on CUDA: plain values, published behind any snapshot still staged."""
        if not self._published(topic):
            return
        if self._waiting:
            self._waiting.append((topic, ts, data or {}, None))  # behind staged snapshots
            self.poll()
        else:
            self._publish(topic, ts, data)

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
        if not self._published(topic):
            return
        if self.cuda:
            self._emit_staged(topic, ts, data)
        else:
            self._publish(topic, ts, _host_values(data))

    def _emit_staged(self, topic: str, ts: tuple, data: dict) -> None:
        staged, ready = self._stager.stage(data)
        if ready is not None:
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


def _nothing(*args: Any) -> None:
    pass


class _Stager:
    """Starts non-blocking copies of a snapshot's CUDA tensors (in dicts, lists and tuples,
    at any depth) into pinned host memory. A tensor staged for the snapshot before is not
    copied again: the step's loss is one tensor in after_loss, after_train_batch and
    batch_end, and each copy costs the training thread an allocation, a launch and an event."""

    def __init__(self) -> None:
        #: the last tensor copied (weakly: a freed tensor's id may be reused), its version
        #: counter then (an in-place change makes it a new value), its copy and the copy's event
        self._last: tuple[weakref.ref, int, torch.Tensor, torch.cuda.Event] | None = None
        self._copied: tuple[torch.Tensor, torch.Tensor] | None = None  # this stage()'s last copy
        self._reused: torch.cuda.Event | None = None  # the event of a copy reused in this stage()

    def stage(self, data: Any) -> tuple[Any, torch.cuda.Event | None]:
        """`data` with host copies in place of its CUDA tensors, and the event recorded
        behind those copies (None where it holds no CUDA tensor)."""
        self._copied = self._reused = None
        staged = self._walk(data)
        if self._copied is None:
            return staged, self._reused
        ready = torch.cuda.Event()  # behind this stage()'s copies, and so any reused one too
        ready.record()
        tensor, host = self._copied
        self._last = (weakref.ref(tensor), tensor._version, host, ready)
        return staged, ready

    def _walk(self, data: Any) -> Any:
        if isinstance(data, torch.Tensor):
            return self._pinned(data) if data.is_cuda else data
        if isinstance(data, dict):
            return {key: self._walk(value) for key, value in data.items()}
        if isinstance(data, (list, tuple)):
            return [self._walk(value) for value in data]
        return data

    def _pinned(self, tensor: torch.Tensor) -> torch.Tensor:
        last = self._last
        if last is not None and last[0]() is tensor and last[1] == tensor._version:
            self._reused = last[3]
            return last[2]
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor.detach(), non_blocking=True)
        self._copied = (tensor, host)
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
