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

__all__ = ["Emitter", "open_emitter", "host_for"]

log = logging.getLogger("offloop.trainer")


def host_for(device: torch.device) -> Callable[[torch.Tensor], Any]:
    """What a snapshot holds for a tensor on `device`: on the CPU a number now (a 0-d
    tensor; no device to wait for) or the tensor detached; on CUDA the tensor, staged later."""
    return _detached if device.type == "cuda" else _host_now


#: the algorithms' engine: run(topic, data) before each event, and the topics it runs at
RunFirst = tuple[Callable[[str, "dict | None"], Any], Container[str]]


def open_emitter(publisher: Publisher | None, device: torch.device, burst_interval: float = 0.0,
                 run_first: RunFirst | None = None) -> Emitter:
    """The run's Emitter, its variant chosen here, once: nothing published (no publisher),
    held and published at once (the CPU), or staged off the GPU first (CUDA); with
    `run_first=(run, topics)` (the algorithms, trainer/algorithms/) `run(topic, data)` is
    called at each event before it is published, and the loop builds the snapshot of every
    event in `topics` (they run whether or not a worker wants it)."""
    if publisher is None:
        emitter: Emitter = _Unpublished(device)
    elif device.type == "cuda":
        emitter = _Staged(publisher, device, burst_interval)
    else:
        emitter = _Held(publisher, device, burst_interval)
    return emitter if run_first is None else _AlgorithmsFirst(emitter, *run_first)


class Emitter:
    """The trainer's one way to publish; `open_emitter()` builds the variant for the run.

    `emit(topic, ts, data=None)` publishes plain values (no tensors); `snapshot(topic, ts,
    data)` values built with `host()`; `emit_tensors(topic, ts, data)` values holding
    tensors anywhere; `wants(topic)` says whether to build an event at all;
    `release_due()` sends what is held once the burst interval has passed, `release()` at
    once, `flush()` after waiting for every staged copy; `poll()` (CUDA) publishes the
    staged snapshots whose copies have finished. Each variant's `emit`, `snapshot`, `wants`
    and `release_due` are the cheapest callables that do its job, fixed when it is built:
    on the CPU `emit` and `snapshot` are the publisher's `held_publish()` (a membership
    test, then a clock read and an append, or a False) and `release_due` its own, so an
    event costs the loop one frame, the publisher's (benchmarks/trainer_overhead.py,
    `floor_bus_on_mean`).
    """

    emit: Callable[..., Any]
    snapshot: Callable[..., Any]
    wants: Callable[[str], bool]
    release_due: Callable[[], Any]
    cuda = False

    def __init__(self, publisher: Publisher | None, device: torch.device) -> None:
        self.publisher = publisher
        self.host = host_for(device)
        self._refused = 0  # publish() raised (a reserved topic, or nothing held)

    @property
    def unencodable(self) -> int:
        """Snapshots that could not be published (a value the wire cannot carry): counted
        and logged, never raised into the training loop."""
        publisher = self.publisher
        return self._refused + (publisher.stats.unencodable if publisher is not None else 0)

    def emit_tensors(self, topic: str, ts: tuple, data: dict) -> None:
        """Publish a snapshot holding tensors: now on the CPU (0-d ones as numbers), or
        once its tensors have left the GPU."""
        raise NotImplementedError

    def release(self) -> None:
        """Send the held events now: wherever the loop may pause (release_due() is the
        per-batch call: it sends once the burst interval has passed)."""
        if self.publisher is not None:
            self.publisher.release()

    def poll(self) -> None:
        """Publish every staged snapshot whose copies have finished, oldest first."""

    def flush(self) -> None:
        """Wait for every staged copy, publish it and release everything held: only where
        the loop may block (fit end, eval() and predict() end, close), never per batch."""
        self.release()

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


def _nothing(*args: Any) -> None:
    pass


class _Unpublished(Emitter):
    """No publisher (`publish=False`): every event is nothing, and no event is wanted."""

    emit = snapshot = emit_tensors = release_due = staticmethod(_nothing)
    wants = staticmethod(frozenset().__contains__)

    def __init__(self, device: torch.device) -> None:
        super().__init__(None, device)


class _Held(Emitter):
    """The CPU: nothing to stage, so an event is the publisher's `held_publish()`."""

    def __init__(self, publisher: Publisher, device: torch.device, burst_interval: float) -> None:
        super().__init__(publisher, device)
        publisher.hold(burst_interval)
        # holding, publishing never raises for the trainer's topics: a value the wire
        # cannot carry is counted when the burst is encoded
        self.emit = self.snapshot = publisher.held_publish()
        self.wants, self.release_due = publisher.wants, publisher.release_due

    def emit_tensors(self, topic: str, ts: tuple, data: dict) -> None:
        if self.wants(topic):
            self._publish(topic, ts, _host_values(data))


class _Staged(Emitter):
    """CUDA: a snapshot's tensors are copied off the GPU first; every event leaves behind
    the snapshots still copying, so the stream stays in order."""

    cuda = True

    def __init__(self, publisher: Publisher, device: torch.device, burst_interval: float) -> None:
        super().__init__(publisher, device)
        publisher.hold(burst_interval)
        self.wants, self.release_due = publisher.wants, publisher.release_due
        self._waiting: deque[tuple[str, tuple, dict, Any]] = deque()
        self._stager = _Stager()

    def emit(self, topic: str, ts: tuple, data: dict | None = None) -> None:
        """Plain values, published behind any snapshot still staged."""
        if not self.wants(topic):
            return
        if self._waiting:
            self._waiting.append((topic, ts, data or {}, None))  # behind staged snapshots
            self.poll()
        else:
            self._publish(topic, ts, data)

    def emit_tensors(self, topic: str, ts: tuple, data: dict) -> None:
        if not self.wants(topic):
            return
        staged, ready = self._stager.stage(data)
        if ready is not None:
            self._waiting.append((topic, ts, staged, ready))
        elif self._waiting:
            self._waiting.append((topic, ts, staged, None))  # keep the stream in order
        else:
            self._publish(topic, ts, staged)
        self.poll()

    snapshot = emit_tensors

    def poll(self) -> None:
        waiting = self._waiting
        while waiting:
            topic, ts, staged, ready = waiting[0]
            if ready is not None and not ready.query():
                return
            waiting.popleft()
            self._publish(topic, ts, _host_values(staged))

    def flush(self) -> None:
        if self._waiting:
            for *_, ready in self._waiting:
                if ready is not None:
                    ready.synchronize()
            self.poll()
        self.release()


class _AlgorithmsFirst(Emitter):
    """Another variant with `run(topic, data)` called before each event is published
    (see open_emitter); built before anything holds the emitter, so every event, the
    control path's too, passes through it."""

    def __init__(self, inner: Emitter, run: Callable[[str, dict | None], Any],
                 topics: Container[str]) -> None:
        self.inner, self.publisher, self.host = inner, inner.publisher, inner.host
        self.cuda = inner.cuda
        self._run, self._topics = run, topics
        self._emit, self._snapshot, self._tensors = inner.emit, inner.snapshot, inner.emit_tensors
        self._published = inner.wants  # what the publisher takes
        self.release_due, self.poll, self.release, self.flush = \
            inner.release_due, inner.poll, inner.release, inner.flush

    @property
    def unencodable(self) -> int:
        return self.inner.unencodable

    def wants(self, topic: str) -> bool:
        return topic in self._topics or self._published(topic)

    def emit(self, topic: str, ts: tuple, data: dict | None = None) -> None:
        self._run(topic, data)
        self._emit(topic, ts, data)

    def snapshot(self, topic: str, ts: tuple, data: dict) -> None:
        self._run(topic, data)
        if self._published(topic):
            self._snapshot(topic, ts, data)

    def emit_tensors(self, topic: str, ts: tuple, data: dict) -> None:
        self._run(topic, data)
        self._tensors(topic, ts, data)


def _host_now(tensor: torch.Tensor) -> Any:
    return tensor.item() if tensor.ndim == 0 else tensor.detach()


def _detached(tensor: torch.Tensor) -> Any:
    return tensor.detach()


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
