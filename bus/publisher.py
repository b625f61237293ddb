"""Publisher: the server half of the ZeroMQ Guide's Clone pattern, with heartbeats.

Promise: `publish()` never waits for a subscriber (a full queue is a counted drop),
skips serializing events nobody subscribed to, and a subscriber that joins mid-run gets
the run config and the latest message of every topic at once.

Sockets (the first is the outbox's, the others the service's)::

    publishing thread  XPUB (NODROP, HWM = queue_size) --inproc--+
      (events; heartbeats too, sent by the service thread under the outbox's lock)
    service thread     XPUB (sees subscriptions) ----------------+--> XSUB ==proxy==>
                                                                      XPUB tcp (events)
    service thread     ROUTER tcp (late-join state, run info, ping)          (state)

The proxy has a thread of its own (`events_proxy`; with keys it caps subscriptions by
connection): the publishing thread pays one non-blocking send per message, and a send that
finds the proxy asleep wakes it (a cross-CPU wake-up: benchmarks/bus.py, `ratio_send_only`);
a loop that publishes many events a step can `hold()` them and `release()` them in one
burst, which wakes the proxy once. Subscribers of everything get each burst as one message
(``_burst``: one receive and one decode for a step's events); subscribers of single topics,
those topics' events one message each.

This class is the façade; its rooms are `interest` (what is wanted), `held` (held events,
numbering, the latest of each topic), `outbox` (the sending socket, its lock and bounds),
the service thread (`publisher_service`, with `late_join`) and `stats` (the counters).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import zmq

from offloop.bus.events import Event
from offloop.bus.held import HOLD_AT_MOST, HeldEvents
from offloop.bus.interest import Interest
from offloop.bus.outbox import Outbox
from offloop.bus.publisher_service import PublisherService
from offloop.bus.publisher_stats import PublisherStats
from offloop.bus.wire import DEFAULT_LIMITS, EventEncoder, Limits

__all__ = ["Publisher", "DEFAULT_RETAINED", "HOLD_AT_MOST"]

#: Topics serialized even with no subscriber, so a late joiner sees them at once.
DEFAULT_RETAINED = frozenset({
    Event.INIT.value, Event.FIT_START.value, Event.EPOCH_START.value, Event.BATCH_END.value,
    Event.EPOCH_END.value, Event.EVAL_END.value, Event.FIT_END.value,
    Event.EVAL_STANDALONE_END.value, Event.PREDICT_END.value, "checkpoint_saved",
    "control_request",
})


class Publisher:
    """Publishes event snapshots for one run and rank; see the module docstring."""

    def __init__(
        self,
        run_id: str,
        *,
        rank: int = 0,
        host: str = "127.0.0.1",
        events_port: int = 0,
        state_port: int = 0,
        queue_size: int = 10_000,
        subscriber_hwm: int = 10_000,
        max_queued_bytes: int = 64 << 20,
        heartbeat_interval: float = 0.5,
        retained: frozenset[str] = DEFAULT_RETAINED,
        limits: Limits = DEFAULT_LIMITS,
        context: zmq.Context | None = None,
        curve=None,
        cap_subscriptions: bool | None = None,
    ) -> None:
        if queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {queue_size}")
        if max_queued_bytes < 1:
            raise ValueError(f"max_queued_bytes must be >= 1, got {max_queued_bytes}")
        if heartbeat_interval <= 0:
            raise ValueError(f"heartbeat_interval must be > 0, got {heartbeat_interval}")
        self.run_id, self.rank = run_id, rank
        self.publisher_id = uuid.uuid4().hex[:12]
        self.heartbeat_interval, self.limits = heartbeat_interval, limits
        self.stats = PublisherStats()
        self.interest = Interest(retained, self.stats)
        #: wants(topic) -> bool: whether `publish(topic, ...)` would serialize it now (a
        #: subscriber wants it or it is retained); `topic` a str or an Event. The public
        #: way to skip building an event nobody wants: a C method, no Python frame.
        self.wants: Callable[[str], bool] = self.interest.wants
        self.held = HeldEvents()
        self._append = self.held.appender(self.interest)  # the one way an event is held
        self.outbox = Outbox(EventEncoder(run_id, self.publisher_id, rank), limits, self.stats,
                             max_queued_bytes, heartbeat_interval)
        self._service = PublisherService(
            interest=self.interest, held=self.held, outbox=self.outbox, stats=self.stats,
            encoder=EventEncoder(run_id, self.publisher_id, rank), limits=limits, curve=curve,
            release=self.release, release_locked=self._release_locked, capped=cap_subscriptions)
        #: refusals() -> {kind: count}: what the run's sockets refused so far, as heartbeats say
        self.refusals: Callable[[], dict[str, int]] = self._service.refusals
        self.late_join = self._service.late_join
        self._own_context, self._ctx = context is None, context or zmq.Context()
        self._host, self._events_port, self._state_port = host, events_port, state_port
        self._queue_size, self._subscriber_hwm = queue_size, subscriber_hwm
        self._inproc = f"inproc://offloop-pub-{self.publisher_id}"
        self.endpoints: dict[str, str] = {}
        self._closed = False

    # ------------------------------------------------------------ lifecycle

    def start(self) -> dict[str, str]:
        """Bind the sockets, start the proxy and service threads, return the endpoints."""
        self.endpoints = self._service.start(self._ctx, self._inproc, self._host,
                                             self._events_port, self._state_port,
                                             self._queue_size, self._subscriber_hwm)
        return dict(self.endpoints)

    def close(self, linger: float = 0.5) -> None:
        """Send final heartbeats for `linger` seconds, then stop every thread and socket."""
        if self._closed or not self.endpoints:
            self._closed = True
            return
        self._closed = True
        self.release(stop_holding=True)  # held events go before the final heartbeats
        self._service.stop(linger)
        self.outbox.close()
        if self._own_context:
            self._ctx.term()

    def count_refusals(self, source: Callable[[], dict[str, int]]) -> None:
        """Heartbeats carry what `source()` counts too (the control server's `refusals`)."""
        self._service.refusal_sources.append(source)

    @property
    def serving(self) -> bool:
        """Whether the service thread (heartbeats, subscriptions, late join) runs."""
        return self._service.alive

    def __enter__(self) -> Publisher:
        if not self.endpoints:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------- hot path

    def publish(self, topic: str | Event, ts: tuple, data: dict | None = None) -> bool:
        """Send one event; False when skipped (nobody wants it) or dropped (queue full).

        `topic` is a str or an Event (sent as its value). `ts` is (epoch, batch,
        batch_in_epoch, sample, token), usually `Timestamp.as_tuple()`: consecutive held
        events whose ts is the very same object share it, packed once in their burst.
        `data` and `ts` are kept as they are, not copied, until the event is encoded (when
        it is sent, or asked for by a late joiner): do not modify them afterwards; tensors
        in `data` must be on the CPU (their bytes are sent without a copy). Raises
        WireError for a topic that is empty, holds NUL or starts with "_" (reserved). A
        value the wire cannot carry is found when the event is encoded: raised here when
        nothing is held, counted in `stats.unencodable` and logged at release(); either
        way that event's sequence numbers are spent, so subscribers count it lost.

        While events are held (the trainer's case) this only appends; numbering and
        encoding happen at release(). Held events are published from one thread at a time.
        """
        if self.held.holding:
            if not self._append(topic, ts, data):
                return False
            if len(self.held.queue) >= HOLD_AT_MOST:
                self._release(whole=True)
            return True
        interest = self.interest
        if topic not in interest.wanted and not (interest.open_prefixes and interest.opens(topic)):
            return False
        with self.outbox.lock:  # the service thread may be releasing what was held before
            return self.outbox.send_now(self.held.number_one(topic, ts, data), interest)

    def hold(self, interval: float = 0.0) -> None:
        """From now on, publish() keeps each event and numbers, encodes and sends it only at
        the next release() (a late joiner's state request releases first, so its state has
        it), or at the next release_due() once `interval` seconds have passed since the last
        burst left or HOLD_AT_MOST (256) events wait; publish() itself releases at once when
        HOLD_AT_MOST wait. Call release_due() at every step of a loop and release() wherever
        it may pause. Held events leave in order, as a burst. While holding, publish from one
        thread (the loop's): an event is kept without its ts when that is the very object
        the event before it had, and two threads could interleave between check and append."""
        if interval < 0:
            raise ValueError(f"hold interval must be >= 0, got {interval}")
        held = self.held
        held.interval = interval
        if not held.holding:
            held.released_at = time.perf_counter()  # the first interval starts now
            held.holding = True

    def held_publish(self) -> Callable[[str, tuple, dict | None], bool]:
        """publish() for the loop that holds: for a wanted topic it only reads the clock and
        appends, and it does not count what waits (the loop calls release_due() at each step,
        which sends once HOLD_AT_MOST wait, so a step of many microbatches may hold more
        until its end). The trainer publishes each event through it: a call is a measurable
        share of a small model's step (benchmarks/trainer_overhead.py, `floor_bus_on_mean`).
        Same contract as publish() otherwise; valid while holding, from the publishing thread."""
        if not self.held.holding:
            raise RuntimeError("held_publish() needs hold() first: its events leave at release()")
        return self._append

    def release_due(self) -> None:
        """release(), if the last burst left at least the hold interval ago or HOLD_AT_MOST
        events wait; from the publishing thread only, at every step (so one frame, no call)."""
        held, queue = self.held, self.held.queue
        if queue and (len(queue) >= HOLD_AT_MOST
                      or time.perf_counter() - held.released_at >= held.interval):
            self._release(whole=True)

    def release(self, *, stop_holding: bool = False) -> None:
        """Send every held event now: one burst message (or several, within the size limits)
        if anyone takes bursts, and each event of a singly subscribed topic as a message of
        its own. A full queue drops and counts, as always; an event the wire cannot carry is
        counted in `stats.unencodable`, logged, and left out. Never raises."""
        self._release(stop_holding=stop_holding)

    def _release(self, *, whole: bool = False, stop_holding: bool = False) -> None:
        """The one release path. `whole`: from the publishing thread, which appends to the
        queue, so nothing does meanwhile and it is taken whole rather than popped."""
        with self.outbox.lock:
            self._release_locked(whole=whole)
            if stop_holding:
                self.held.holding = False

    def _release_locked(self, *, whole: bool = False) -> None:
        if held := self.held.take(whole=whole):
            self.outbox.send_released(held, *self.held.number(held), self.interest)

    # ---------------------------------------------------------- what it says

    @property
    def seq(self) -> int:
        """The last sequence number spent: events numbered so far (held ones are not)."""
        return self.held.seq

    def topic_seq(self, topic: str) -> int:
        """Events of `topic` numbered so far."""
        return self.held.tseq.get(topic, 0)

    @property
    def config(self) -> dict[str, Any]:
        """The run config every late joiner receives first (set_config())."""
        return self.late_join.config

    def set_config(self, config: dict[str, Any]) -> None:
        self.late_join.config = dict(config)

    @property
    def run_info(self) -> dict[str, Any]:
        """run.json, for info requests at the state socket (trimmed there without keys)."""
        return self.late_join.run_info

    @run_info.setter
    def run_info(self, info: dict[str, Any]) -> None:
        self.late_join.run_info = info
