"""Publisher: the server half of the ZeroMQ Guide's Clone pattern, with heartbeats.

Promise: `publish()` never waits for a subscriber (a full queue is a counted drop),
skips serializing events nobody subscribed to, and a subscriber that joins
mid-run gets the run config and the latest message of every topic at once.

Sockets, all owned here::

    publishing thread  XPUB (NODROP, HWM = queue_size) --inproc--+
      (events; heartbeats too, sent by the service thread under the send lock)
    service thread     XPUB (sees subscriptions) ----------------+--> XSUB ==proxy(C)==> XPUB tcp  (events)
    service thread     ROUTER tcp (late-join state, run info, ping)                                 (state)

The proxy runs in libzmq without the GIL, so the publishing thread pays one
non-blocking send per event and nothing more. A send that finds the proxy asleep wakes
it, which costs the sender a cross-CPU wake-up (benchmarks/bus.py, `ratio_send_only`); a
loop that publishes many events a step can `hold()` them and `release()` them in one
burst, which wakes the proxy once. Subscribers of everything get each burst as one
message (topic ``_burst``: one receive and one decode for a whole step's events);
subscribers of single topics get those topics' events as messages of their own.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable
from itertools import repeat, starmap
from operator import itemgetter
from typing import Any

import zmq

from offloop.bus.events import RUN_TOPICS, Event
from offloop.bus.events_proxy import run_events_proxy
from offloop.bus.wire import (
    BURST_PREFIX,
    DEFAULT_LIMITS,
    HEARTBEAT_TOPIC,
    EventEncoder,
    Limits,
    WireError,
    decode_request,
    encode_heartbeat,
    encode_reply,
    entry_ts,
    split_envelope,
    topic_prefix,
)

__all__ = ["Publisher", "DEFAULT_RETAINED", "HOLD_AT_MOST"]

log = logging.getLogger("offloop.bus")

#: Topics serialized even with no subscriber, so a late joiner sees them at once.
DEFAULT_RETAINED = frozenset(
    {
        Event.INIT.value,
        Event.FIT_START.value,
        Event.EPOCH_START.value,
        Event.BATCH_END.value,
        Event.EPOCH_END.value,
        Event.EVAL_END.value,
        Event.FIT_END.value,
        Event.EVAL_STANDALONE_END.value,
        Event.PREDICT_END.value,
        "checkpoint_saved",
        "control_request",
    }
)

_HB_PREFIX = topic_prefix(HEARTBEAT_TOPIC)
_DRAIN_EVERY = 4096  # the publishing socket's own copy of the subscriptions is drained this often
HOLD_AT_MOST = 256  # held events sent anyway once this many wait (held_publish(): at release_due())
#: late-join requests answered together in one round of the service thread (one settle wait)
STATE_BATCH = 64
#: open topic prefixes (subscriptions not ending in a full topic) matched one by one on
#: the training thread; beyond this many, every topic is published (see _track_subscriptions)
MAX_OPEN_PREFIXES = 64
#: the largest message a peer may send into the events socket: (un)subscriptions are a
#: byte and a topic prefix; anything longer is not one
MAX_SUBSCRIPTION_BYTES = 4096
#: events messages this large or larger are counted against max_queued_bytes until libzmq
#: has handed them to every subscriber's connection; smaller ones (a step's burst on a
#: model of real size is 1-2 KiB) are bounded by the subscriber queue's message count alone
TRACKED_BYTES = 4096
#: a counted message of one frame under 64 KiB (a burst of fast steps) is copied and sent
#: untracked: a tracker wakes pyzmq's garbage-collector thread, which takes the GIL from the
#: loop (benchmarks/trainer_overhead.py, `ratio_bus_on_mean`). One is tracked whenever 1/TRACK_SHARE
#: of max_queued_bytes has gone untracked; its tracker stands for those before it too, as
#: every connection takes messages in order
TRACK_SHARE = 64
#: released bursts kept for the service thread to fold into the late-join state; past this
#: many the releasing thread folds them itself
FOLD_AT_MOST = 64
_STALL_CHECK = 0.05  # seconds: held events older than this (and the interval) leave from the service thread
_SUBSCRIPTION_SETTLE = 0.01  # seconds; libzmq's max_command_delay is 3M TSC ticks (~1 ms)
_JOIN_WAIT = 0.5  # seconds a state request waits for its joiner's subscriptions to reach the watcher


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
    ) -> None:
        if queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {queue_size}")
        if max_queued_bytes < 1:
            raise ValueError(f"max_queued_bytes must be >= 1, got {max_queued_bytes}")
        if heartbeat_interval <= 0:
            raise ValueError(f"heartbeat_interval must be > 0, got {heartbeat_interval}")
        self.run_id, self.rank = run_id, rank
        self.publisher_id = uuid.uuid4().hex[:12]
        self.heartbeat_interval = heartbeat_interval
        self.limits = limits
        self.config: dict[str, Any] = {}
        self.run_info: dict[str, Any] = {}
        self.seq = 0
        self.drops = 0
        self.state_requests = 0
        self.bad_requests = 0
        #: state and info requests refused: their key is no longer authorised (with keys)
        self.unauthorized = 0
        #: times every events connection was cut because a key lost its role (with keys)
        self.cuts = 0
        self.beats = 0
        self.unencodable = 0  # held events left out at release(): a value the wire cannot carry
        #: the bound in bytes: large messages (TRACKED_BYTES or more) not yet written to every
        #: subscriber's connection may hold this much; one more is dropped and counted in
        #: `drops` (heartbeats carry it) and in `byte_drops`
        self.max_queued_bytes = max_queued_bytes
        self.byte_drops = 0
        #: trackers not yet done, each with the bytes it releases (its own and the untracked
        #: messages sent before it), and the bytes sent untracked since the last tracker
        self._in_flight: deque[tuple[zmq.MessageTracker, int]] = deque()  # under _send_lock
        self._untracked = 0
        self.queued_bytes = 0
        for topic in retained:
            _check_topic(topic)
        self._retained = frozenset(retained)
        # topics encoded when published: changed in place (additions before removals), so
        # `wants` is the set's own C `__contains__`, a call that costs no Python frame (an
        # Event is a str of its value: it hashes and compares as its topic)
        self._wanted: set[str] = set(self._retained)
        self.wants = self._wanted.__contains__
        # orders _opens() (publishing thread, a topic's first publish) with the service
        # thread's update of _wanted/_single: neither may undo the other's half
        self._wanted_lock = threading.Lock()
        self._single: frozenset[str] = frozenset()  # topics sent as messages of their own
        self._burst = False  # someone takes bursts (a subscriber of everything)
        #: messages a peer sent into the events socket that were not (un)subscriptions
        self.foreign_messages = 0
        #: more than MAX_OPEN_PREFIXES open prefixes were subscribed at once, at some point
        self.prefix_overflow = False
        # open prefixes: topics outside RUN_TOPICS that they select join `_wanted` (and,
        # for a prefix other than the burst's, `_single`) the first time they are published
        self._open_prefixes: tuple[str, ...] = ()
        self._single_prefixes: tuple[str, ...] = ()
        self._seen_topics: set[str] = set()
        self._subscriptions: set[bytes] = set()  # SUB prefixes in force; service thread only
        self._tseq: dict[str, int] = {}
        # hold(): publish() (or held_publish()'s function) only appends (topic, t, data, ts),
        # or (topic, t, data) when ts is the very object the entry before it had: a burst's
        # own layout. release() numbers the held events (seq, tseq) and sends them, all under
        # _send_lock, which also orders the sends. The publishing thread appends, whoever
        # releases pops; neither replaces the deque (held_publish() holds its append). A
        # held event has no sequence number yet, so no heartbeat counts it.
        self._holding = False
        self._hold_interval = 0.0  # release_due() sends only once this long after the last burst
        self._released_at = 0.0
        self._held: deque[tuple] = deque()
        #: the ts of the last entry appended, in a cell held_publish()'s function shares
        #: (publishing thread only)
        self._held_ts: list[Any] = [_NO_TS]
        self._released_ts: Any = None  # the ts of the last entry released (under _send_lock)
        self._send_lock = threading.Lock()
        self._latest: dict[str, list] = {}  # [topic, seq, tseq, t, ts, data] of each topic
        # released (seq, first tseq, entries) not yet folded into _latest: the service thread
        # folds them, off the loop (_fold); a late joiner's state folds them first
        self._unfolded: list[tuple[int, dict[str, int], list]] = []
        self._encoder = EventEncoder(run_id, self.publisher_id, rank)
        self._state_encoder = EventEncoder(run_id, self.publisher_id, rank)  # service thread's
        self._own_context = context is None
        self._ctx = context or zmq.Context()
        self._host, self._events_port, self._state_port = host, events_port, state_port
        self._queue_size, self._subscriber_hwm = queue_size, subscriber_hwm
        self._threads: list[threading.Thread] = []
        self._inproc = f"inproc://offloop-pub-{self.publisher_id}"
        self.endpoints: dict[str, str] = {}
        self._closed = False
        self._curve = curve  # bus.security.ServerKeys: the public sockets become CURVE servers
        self._cut = threading.Event()  # the proxy thread's cue to drop every events connection
        self._revocations_seen = curve.access.revocations if curve is not None else 0

    # ------------------------------------------------------------ lifecycle

    def start(self) -> dict[str, str]:
        """Bind the sockets, start the proxy and service threads, return the endpoints."""
        ctx = self._ctx
        front = ctx.socket(zmq.XSUB)
        front.rcvhwm = 1
        front.bind(self._inproc)
        back = ctx.socket(zmq.XPUB)
        back.sndhwm = self._subscriber_hwm
        back.linger = 0
        # what reaches it from a peer is a subscription, a topic prefix: a peer sending more
        # is disconnected by libzmq before the bytes are buffered
        back.maxmsgsize = MAX_SUBSCRIPTION_BYTES
        if self._curve is not None:
            self._curve.apply(back)
        events = self._bind(back, self._events_port)
        proxy_ctl = ctx.socket(zmq.PAIR)
        proxy_ctl.bind(self._inproc + "-proxy")
        self._proxy_ctl = ctx.socket(zmq.PAIR)
        self._proxy_ctl.connect(self._inproc + "-proxy")

        router = ctx.socket(zmq.ROUTER)
        router.maxmsgsize = self.limits.max_body_bytes
        router.linger = 0
        if self._curve is not None:
            self._curve.apply(router)
        state = self._bind(router, self._state_port)
        watcher = ctx.socket(zmq.XPUB)
        watcher.connect(self._inproc)
        stop = ctx.socket(zmq.PAIR)
        stop.bind(self._inproc + "-stop")
        self._stop = ctx.socket(zmq.PAIR)
        self._stop.connect(self._inproc + "-stop")

        self._tx = ctx.socket(zmq.XPUB)
        self._tx.setsockopt(zmq.XPUB_NODROP, 1)
        self._tx.sndhwm = self._queue_size
        self._tx.linger = 0
        self._tx.connect(self._inproc)

        self.endpoints = {"events": events, "state": state}
        self._threads = [
            threading.Thread(target=run_events_proxy, args=(front, back, proxy_ctl, self._cut, events), daemon=True,
                             name="offloop-proxy"),
            threading.Thread(target=self._serve, args=(watcher, router, stop), daemon=True,
                             name="offloop-publisher"),
        ]
        for thread in self._threads:
            thread.start()
        return dict(self.endpoints)

    def _bind(self, sock: zmq.Socket, port: int) -> str:
        sock.bind(f"tcp://{self._host}:{port or '*'}")
        return sock.last_endpoint.decode()

    def close(self, linger: float = 0.5) -> None:
        """Send final heartbeats for `linger` seconds, then stop every thread and socket."""
        if self._closed or not self._threads:
            self._closed = True
            return
        self._closed = True
        self.release(stop_holding=True)  # held events go before the final heartbeats
        self._stop.send(str(linger).encode())
        self._threads[1].join(timeout=linger + 5)
        self._proxy_ctl.send(b"TERMINATE")
        self._threads[0].join(timeout=5)
        for sock in (self._tx, self._stop, self._proxy_ctl):
            sock.close(linger=0)
        if self._own_context:
            self._ctx.term()

    def __enter__(self) -> Publisher:
        if not self._threads:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------- hot path

    #: wants(topic) -> bool: whether `publish(topic, ...)` would serialize it now (a
    #: subscriber wants it or it is retained); `topic` a str or an Event. The public way
    #: to skip building an event nobody wants; bound in __init__ to a C method, so a
    #: call costs no Python frame.
    wants: Callable[[str], bool]

    def publish(self, topic: str | Event, ts: tuple, data: dict | None = None) -> bool:
        """Send one event; False when skipped (nobody wants it) or dropped (queue full).

        `topic` is a str or an Event (sent as its value). `ts` is (epoch, batch,
        batch_in_epoch, sample, token), usually `Timestamp.as_tuple()`: consecutive held
        events whose ts is the very same object (a Timestamp gives one tuple object for
        its whole life) share it, packed once in their burst. `data` and `ts` are kept
        as they are, not copied, until the event is encoded (when it is sent, or asked
        for by a late joiner): do not modify them afterwards; tensors in `data` must be
        on the CPU (their bytes are sent without a copy). Raises WireError for a topic
        that is empty, holds NUL or starts with "_" (reserved). A value the wire cannot
        carry is found when the event is encoded: raised here when nothing is held,
        counted in `unencodable` and logged at release(); either way that event's
        sequence numbers are spent, so subscribers count it lost.

        While events are held (the trainer's case) this is the hot path: one membership
        test, a clock read and an append; numbering and encoding happen at release().
        Held events are published from one thread at a time (the loop's).
        """
        if topic not in self._wanted and not (self._open_prefixes and self._opens(topic)):
            return False
        if self._holding:
            held, last = self._held, self._held_ts
            if ts is last[0]:  # the same Timestamp's tuple as the entry before: packed once
                held.append((topic, time.time(), data))
            else:
                last[0] = ts
                held.append((topic, time.time(), data, ts))
            if len(held) >= HOLD_AT_MOST:
                self._release_own()
            return True
        with self._send_lock:  # the service thread may be releasing what was held before
            self._fold()  # what was released before this event is older than it
            seq = self._advance(1)
            n = self._tseq[topic] = self._tseq.get(topic, 0) + 1
            event = self._latest[topic] = [topic, seq, n, time.time(), ts, data if data is not None else {}]
            sent = True
            if topic in self._single:
                sent = self._send(self._encoder.encode_event(event))
            if self._burst:
                for frames in self._encoder.bursts([event], self.limits):
                    sent = self._send(frames) and sent
        return sent

    def _advance(self, n: int) -> int:
        """Spend `n` sequence numbers; the first of them. Under _send_lock."""
        first = self.seq + 1
        self.seq += n
        if self.seq // _DRAIN_EVERY != (first - 1) // _DRAIN_EVERY:
            self._drain_own_subscriptions()
        return first

    def _number(self, held: list) -> tuple[int, dict[str, int]]:
        """Number held entries in publishing order: (the first one's seq, each topic's
        first tseq). Per topic rather than per event: the entries go out as they are; the
        latest of each topic, for late joiners, is found later (_fold). Under _send_lock."""
        if len(held[0]) == 3:  # its ts is the last one released (the entry before it)
            held[0] = (*held[0], self._released_ts)
        seq = self._advance(len(held))
        # each topic once (a burst holds a few), counted by list.count in C: Counter's Python
        # layers cost a release more, cold (benchmarks/bus.py, `burst_every_step_median_us`)
        tseq, first, topics = self._tseq, {}, list(map(_TOPIC, held))
        for topic in dict.fromkeys(topics):
            n = tseq.get(topic, 0)
            first[topic] = n + 1
            tseq[topic] = n + topics.count(topic)
        self._unfolded.append((seq, first, held))
        if len(self._unfolded) >= FOLD_AT_MOST:  # the service thread is late: bound what waits
            self._fold()
        self._released_ts = entry_ts(held, -1)
        return seq, first

    def _fold(self) -> None:
        """Keep the latest event of each topic released since the last fold as a whole event
        [topic, seq, tseq, t, ts, data], newest releases first. Under _send_lock."""
        unfolded, latest, done = self._unfolded, self._latest, set()
        while unfolded:
            seq, first, held = unfolded.pop()
            topics = list(map(_TOPIC, held))
            counts = Counter(topics)
            for topic, i in dict(zip(topics, range(len(held)), strict=True)).items():  # each one's last
                if topic not in done:
                    done.add(topic)
                    data = held[i][2]
                    latest[topic] = [topic, seq + i, first[topic] + counts[topic] - 1, held[i][1],
                                     entry_ts(held, i), data if data is not None else {}]

    def _send(self, frames: list) -> bool:
        """Send one message; a full queue, or the byte bound, drops and counts it. Under _send_lock."""
        try:
            if len(frames) == 1:
                size = len(frames[0])
                if size < TRACKED_BYTES:  # the usual message: small, copied
                    self._tx.send(frames[0], zmq.NOBLOCK)
                    return True
                # copied below pyzmq's own line between copying and zero-copy (64 KiB)
                if size < zmq.COPY_THRESHOLD and self._untracked + size < self.max_queued_bytes // TRACK_SHARE:
                    return self._send_counted(frames[0], size)
            else:
                size = sum(f.nbytes if isinstance(f, memoryview) else len(f) for f in frames)
                if size < TRACKED_BYTES:
                    self._tx.send_multipart(frames, zmq.NOBLOCK, copy=False)
                    return True
            return self._send_tracked(frames, size)
        except zmq.Again:
            self.drops += 1
            return False

    def _has_room(self, size: int) -> bool:
        """Whether a counted message of `size` bytes fits under max_queued_bytes, once the
        messages whose trackers are done are taken off; if not, it is dropped and counted."""
        in_flight = self._in_flight
        while in_flight and in_flight[0][0].done:
            self.queued_bytes -= in_flight.popleft()[1]
        if self.queued_bytes + size <= self.max_queued_bytes:
            return True
        self.drops += 1
        self.byte_drops += 1
        if self.byte_drops == 1 or self.byte_drops % 1000 == 0:
            log.warning("offloop: an events message of %d bytes was dropped (%d so far): %d bytes of "
                        "messages still wait for a subscriber that is not reading (max_queued_bytes %d)",
                        size, self.byte_drops, self.queued_bytes, self.max_queued_bytes)
        return False

    def _send_counted(self, frame: bytes, size: int) -> bool:
        """A counted message of one frame, copied and untracked: it stays in `queued_bytes`
        until the next tracked message's tracker is done."""
        if not self._has_room(size):
            return False
        self._tx.send(frame, zmq.NOBLOCK)
        self.queued_bytes += size
        self._untracked += size
        return True

    def _send_tracked(self, frames: list, size: int) -> bool:
        """A large message, counted in `queued_bytes` until libzmq lets go of its last frame
        (each subscriber's connection takes a message's frames in order, so the last one is
        released last): by then every subscriber's kernel buffer has it, or its queue
        dropped it. Libzmq keeps one copy for all subscribers, so this bounds them together.
        Its tracker also releases the untracked messages sent before it."""
        if not self._has_room(size):
            return False
        last = zmq.Frame(frames[-1], copy=False, track=True)
        self._tx.send_multipart([*frames[:-1], last], zmq.NOBLOCK, copy=False)
        self._in_flight.append((last.tracker, size + self._untracked))
        self.queued_bytes += size
        self._untracked = 0
        return True

    def _opens(self, topic: str) -> bool:
        """A topic outside RUN_TOPICS that an open prefix selects: wanted from now on.
        Raises WireError for a reserved or malformed topic (nothing else checks them:
        every topic in `_wanted` has been checked once)."""
        if not self._open_prefixes or not topic.startswith(self._open_prefixes):
            return False
        _check_topic(topic)
        with self._wanted_lock:
            self._seen_topics.add(topic)
            if self._single_prefixes and topic.startswith(self._single_prefixes):
                self._single = self._single | {topic}
            self._wanted.add(topic)  # last: where it goes is known before it is wanted
        return True

    def hold(self, interval: float = 0.0) -> None:
        """From now on, publish() keeps each event and numbers, encodes and sends it only
        at the next release() (a late joiner's state request releases first, so its state
        has it), or at the next release_due() once `interval` seconds have passed since the
        last burst left or HOLD_AT_MOST (256) events wait. Call release_due() at every step
        of a loop and release() wherever it may pause. Held events leave in order, as a
        burst. publish() releases at once when HOLD_AT_MOST wait; held_publish() leaves that
        count to release_due(), so a step of many events may hold more until its end. While holding, publish
        from one thread (the loop's): an event is kept without its ts when that is the very
        object the event before it had, and two publishing threads could interleave
        between that check and the append."""
        if interval < 0:
            raise ValueError(f"hold interval must be >= 0, got {interval}")
        self._hold_interval = interval
        if not self._holding:
            self._released_at = time.perf_counter()  # the first interval starts now
            self._holding = True

    def held_publish(self) -> Callable[[str, tuple, dict | None], bool]:
        """publish() for the loop that holds, made once: for a topic someone wants it only
        reads the clock and appends, with no attribute lookup and no count of what waits
        (the loop calls release_due() at each step, which sends once HOLD_AT_MOST wait, so
        a step of many microbatches may hold more until its end). A topic nobody wants
        returns False at once; one an open prefix may select goes through publish(). The
        trainer publishes each event through it: a call is a measurable share of a small
        model's step (benchmarks/trainer_overhead.py, `floor_bus_on_mean`). Same contract as publish()
        otherwise; valid while holding, from the publishing thread."""
        if not self._holding:
            raise RuntimeError("held_publish() needs hold() first: its events leave at release()")
        publisher, wanted, last, clock = self, self._wanted, self._held_ts, time.time
        hold = self._held.append

        def publish_held(topic: str, ts: tuple, data: dict | None = None) -> bool:
            if topic in wanted:  # the set itself, changed in place by the service thread
                if ts is last[0]:
                    hold((topic, clock(), data))
                else:
                    last[0] = ts
                    hold((topic, clock(), data, ts))
                return True
            if not publisher._open_prefixes:  # nobody wants it (the usual miss)
                return False
            return publisher.publish(topic, ts, data)  # an open prefix may select it: opened there

        return publish_held

    def release_due(self) -> None:
        """release(), if the last burst left at least the hold interval ago or HOLD_AT_MOST
        events wait. From the publishing thread only (the loop's, where release() may come
        from any thread)."""
        held = self._held
        if held and (len(held) >= HOLD_AT_MOST or time.perf_counter() - self._released_at >= self._hold_interval):
            self._release_own()

    def _release_own(self) -> None:
        """release() from the publishing thread: nothing appends meanwhile, so it takes the
        held queue whole (copied, then cleared: held_publish() appends to this deque)
        instead of popping it event by event."""
        with self._send_lock:
            queue = self._held
            if queue:
                held = list(queue)
                queue.clear()
                self._release_entries(held)

    def release(self, *, stop_holding: bool = False) -> None:
        """Send every held event now: one burst message (or several, within the size
        limits) if anyone takes bursts, and each event of a singly subscribed topic as a
        message of its own. A full queue drops and counts, as always; an event the wire
        cannot carry is counted in `unencodable`, logged, and left out. Never raises."""
        with self._send_lock:
            self._release_held()
            if stop_holding:
                self._holding = False

    def _release_held(self) -> None:
        """Number and send everything held now, popped (the publishing thread may be
        appending). Under _send_lock."""
        queue = self._held
        if queue:
            self._release_entries(list(starmap(queue.popleft, repeat((), len(queue)))))  # popped in C

    def _release_entries(self, held: list) -> None:
        """Number and send entries taken from the held queue. Under _send_lock."""
        self._released_at = time.perf_counter()
        seq, first = self._number(held)
        self._send_held(held, seq, first)

    def _send_held(self, held: list, seq: int, first: dict[str, int]) -> None:
        encoder = self._encoder
        events = None  # the whole events, made only where they are needed
        if self._burst:
            try:
                bursts = encoder.burst(seq, first, held, self.limits)
            except Exception:  # one event the wire cannot carry: leave it out, send the rest
                events = self._encodable(_whole_events(held, seq, first))
                try:
                    bursts = encoder.bursts(events, self.limits) if events else []
                except Exception:  # not found one by one: none of them is sent, every one counted
                    self._encodable(events, everything=True)
                    events, bursts = [], []
            for frames in bursts:
                self._send(frames)
        single = self._single
        if single:
            for event in events if events is not None else _whole_events(held, seq, first):
                if event[0] in single:
                    try:
                        frames = encoder.encode_event(event)
                    except Exception:
                        self._encodable([event])
                        continue
                    self._send(frames)

    def _encodable(self, events: list[list], everything: bool = False) -> list[list]:
        """The events the wire can carry; the others are counted and logged (all of
        them with `everything`: a batch that failed as a whole)."""
        if everything:
            good, bad = [], [(event, "its burst could not be encoded") for event in events]
        else:
            good, bad = self._encoder.split_unencodable(events)
        for event, why in bad:
            self.unencodable += 1
            if self.unencodable == 1 or self.unencodable % 1000 == 0:
                log.warning("offloop: %s event not sent (%d so far): %s", event[0],
                            self.unencodable, why)
        return good

    def set_config(self, config: dict[str, Any]) -> None:
        """The run config every late joiner receives first."""
        self.config = dict(config)

    def _drain_own_subscriptions(self) -> None:
        # The publishing XPUB queues a copy of each subscription change; the service
        # thread tracks them from its own socket, so these are only discarded.
        try:
            while True:
                self._tx.recv(zmq.NOBLOCK)
        except zmq.Again:
            pass

    # ------------------------------------------------------- service thread

    def _serve(self, watcher: zmq.Socket, router: zmq.Socket, stop: zmq.Socket) -> None:
        poller = zmq.Poller()
        for sock in (watcher, router, stop):
            poller.register(sock, zmq.POLLIN)
        next_beat = time.monotonic()
        try:
            while True:
                now = time.monotonic()
                if now >= next_beat:
                    self._beat()
                    next_beat = now + self.heartbeat_interval
                    self._cut_revoked()
                wait = max(0.0, next_beat - time.monotonic())
                if self._holding:
                    wait = min(wait, _STALL_CHECK)
                ready = dict(poller.poll(wait * 1000))
                self._release_stalled()
                if self._unfolded:
                    with self._send_lock:
                        self._fold()
                if watcher in ready:
                    self._track_subscriptions(watcher)
                if router in ready:
                    self._answer(router, watcher)
                if stop in ready:
                    self._final_beats(float(stop.recv()))
                    return
        finally:
            for sock in (watcher, router, stop):
                sock.close(linger=0)

    def _cut_revoked(self) -> None:
        """A key that lost its role keeps no events connection: libzmq checks a key only at
        the handshake and cannot drop one peer of a PUB socket, so the proxy thread unbinds
        and rebinds the events socket. Every subscriber reconnects at once (what it missed
        meanwhile is counted as lost, as any gap); the revoked one's handshake now fails."""
        if self._curve is None:
            return
        self._curve.access.refresh()
        if self._curve.access.revocations > self._revocations_seen:
            self._revocations_seen = self._curve.access.revocations
            self.cuts += 1
            self._cut.set()
            self._proxy_ctl.send(b"TERMINATE")  # the proxy returns, rebinds, and runs again

    def _release_stalled(self) -> None:
        """Held events the publishing loop has not released for a while (it is stuck in
        a data loader, a long eval step, user code) leave from here."""
        if self._holding and self._held and time.perf_counter() - self._released_at \
                >= max(self._hold_interval, _STALL_CHECK):
            self.release()

    def _beat(self, final: bool = False) -> None:
        """One heartbeat, sent down the events' own pipe under _send_lock: it leaves behind
        every event numbered before it, so no subscriber sees a heartbeat overtake events
        it announces and counts them lost (then duplicated) while they are still queued."""
        self.beats += 1
        with self._send_lock:
            beat = encode_heartbeat(self.run_id, self.publisher_id, self.rank, self.seq, dict(self._tseq),
                                    self.drops, self.heartbeat_interval, self.beats, final)
            try:
                self._tx.send(beat, zmq.NOBLOCK)
            except zmq.Again:  # the queue is full of events: the next heartbeat says it all
                pass

    def _final_beats(self, linger: float) -> None:
        # Several final heartbeats, so one lost to a full subscriber queue is not the last word.
        deadline = time.monotonic() + linger
        while True:
            self._beat(final=True)
            if time.monotonic() >= deadline:
                return
            time.sleep(min(0.1, linger))

    def _track_subscriptions(self, watcher: zmq.Socket) -> None:
        while watcher.poll(0):
            change = watcher.recv()
            if not change or change[0] not in (0, 1):  # not a subscription or unsubscription
                self.foreign_messages += 1  # ignored, counted: it changes no one's subscriptions
                continue
            (self._subscriptions.add if change[0] == 1 else self._subscriptions.discard)(change[1:])
        subscriptions = tuple(self._subscriptions)
        # b"", b"_", ... b"_burst\0" select bursts: every event, one message per burst
        burst = any(BURST_PREFIX.startswith(p) for p in subscriptions)
        per_topic = [p for p in subscriptions if p != _HB_PREFIX and not BURST_PREFIX.startswith(p)]
        prefixes = tuple(p.decode(errors="replace") for p in per_topic if not p.endswith(b"\0"))
        with self._wanted_lock:  # a topic _opens() adds meanwhile is in `seen` or added after
            seen = tuple(self._seen_topics)
            single = _topics_for(per_topic)
            if prefixes:
                single |= {t for t in seen if t.startswith(prefixes)}
            wanted = self._retained | single
            if burst:
                wanted |= frozenset(RUN_TOPICS) | frozenset(seen)
            self._single, self._single_prefixes = frozenset(single), prefixes
            self._burst = burst
            # more open prefixes than MAX_OPEN_PREFIXES: matched as one, "everything" (the
            # events socket still filters per subscriber), so the training thread's check of
            # a new topic stays one startswith, whatever a peer subscribes to
            crowded = len(prefixes) > MAX_OPEN_PREFIXES
            if crowded and not self.prefix_overflow:
                log.warning("offloop: %d open topic prefixes subscribed (more than %d): every topic is "
                            "published from now on, and each subscriber's socket filters", len(prefixes),
                            MAX_OPEN_PREFIXES)
            self.prefix_overflow = self.prefix_overflow or crowded
            self._open_prefixes = ("",) if burst or crowded else prefixes
            current = self._wanted  # in place, each step one C call: no topic still wanted goes missing
            current |= wanted
            current -= current - wanted

    def _answer(self, router: zmq.Socket, watcher: zmq.Socket) -> None:
        """Answer what waits at the state socket, STATE_BATCH requests a round: info and bad
        requests at once, the late-join requests together (one settle wait and one
        snapshot for all of them), so a backlog never holds up heartbeats or close()."""
        joiners: list[tuple[list[bytes], list[str] | None]] = []
        while len(joiners) < STATE_BATCH and router.poll(0):
            frames = router.recv_multipart(copy=False)
            split = split_envelope(frames)  # from a client, or relayed by `offloop relay`
            if split is None:
                self.bad_requests += 1
                router.send_multipart([frames[0].bytes, encode_reply(
                    "error", error=f"a request is one frame; got {len(frames) - 1}")])
                continue
            envelope, body = split
            refusal = self._curve.access.refusal(body.get("User-Id")) if self._curve is not None else None
            if refusal:  # a key revoked after its connection was made
                self.unauthorized += 1
                router.send_multipart([*envelope, encode_reply("error", error=refusal)])
                continue
            try:  # a state_req's topics are checked there; an info_req's other fields are not read
                request = decode_request(body, self.limits)
            except WireError as exc:
                self.bad_requests += 1
                router.send_multipart([*envelope, encode_reply("error", error=str(exc))])
                continue
            kind = request["k"]
            if kind == "state_req":
                self.state_requests += 1
                joiners.append((envelope, request["topics"]))
            elif kind == "info_req":
                router.send_multipart([*envelope, encode_reply("info", run=self._info_for_peer())])
            else:
                self.bad_requests += 1
                router.send_multipart(
                    [*envelope, encode_reply("error", error=f"{kind!r} is not served on the state socket")]
                )
        if not joiners:
            return
        # Each joiner's topics must be in the wanted set before its state is taken, or what
        # is published after the state would be numbered and not sent (counted lost): its
        # subscriptions reach the watcher through the proxy, which a busy machine delays.
        self._await_subscriptions(watcher, [topics for _, topics in joiners])
        # A joiner trusts this state only once it has received the heartbeat sent just
        # before it: it passed the publishing socket's filter, so the joiner's subscriptions
        # had reached that socket. The publishing socket gets time to apply them (libzmq
        # applies subscriptions on a send at most once per ~1 ms), so nothing published
        # after the state is filtered out.
        self._beat()
        self._track_subscriptions(watcher)
        time.sleep(_SUBSCRIPTION_SETTLE)
        with self._send_lock:  # what is held leaves first: the state then has it
            self._release_held()
            snapshot = self._state_snapshot()
        for envelope, topics in joiners:
            router.send_multipart([*envelope, *self._state_frames(snapshot, topics)], copy=False)

    def _await_subscriptions(self, watcher: zmq.Socket, joiners: list[list[str] | None]) -> None:
        """Track subscriptions until every joiner's topics (None: everything, as bursts) are
        sent, or _JOIN_WAIT has passed (a client that asks for the state without subscribing)."""
        deadline = time.monotonic() + _JOIN_WAIT
        while True:
            self._track_subscriptions(watcher)
            if all(self._burst if topics is None else self._single.issuperset(topics) for topics in joiners):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                return
            watcher.poll(min(left, 0.05) * 1000)

    def _info_for_peer(self) -> dict[str, Any]:
        """run.json for an authorised key; without keys any local account can ask, so only
        what connecting needs (and the config, which the late-join state carries anyway):
        not the run's folder, progress, checkpoints or who stopped it."""
        if self._curve is not None:
            return self.run_info
        info = {k: v for k, v in self.run_info.items() if k in _PUBLIC_INFO}
        if "extra" in self.run_info:
            info["extra"] = {"config": self.run_info["extra"].get("config", {})}
        return info

    def _state_snapshot(self) -> tuple:
        """Under _send_lock, where every numbered event is also the latest of its topic: the
        latest events, encoded, with counters that count none the state does not hold."""
        self._fold()
        entries = []
        for event in sorted(self._latest.values(), key=lambda event: event[1]):
            try:
                entries.append((event[0], self._state_encoder.encode_event(event)))
            except Exception:  # counted when it was released; a late joiner starts after it
                continue
        return self.seq, dict(self._tseq), self.beats, entries

    def _state_frames(self, snapshot: tuple, topics: list[str] | None) -> list:
        """The late-join state: a header naming each entry's frame count, then the entries
        (those of `topics`, or all)."""
        seq, tseq, beats, entries = snapshot
        if topics is not None:
            wanted = set(topics)
            entries = [(topic, frames) for topic, frames in entries if topic in wanted]
        header = encode_reply(
            "state", run=self.run_id, pub=self.publisher_id, rank=self.rank, seq=seq,
            tseq=tseq, beat=beats, config=self.config,
            entries=[len(frames) for _, frames in entries],
        )
        out: list = [header]
        for _, frames in entries:
            out.extend(frames)
        return out


_TOPIC = itemgetter(0)  # a held entry's topic
_NO_TS = object()  # no held entry has this ts: the first one appended always carries its own
#: run.json's fields an info request gets from a run without keys
_PUBLIC_INFO = frozenset({"run_id", "run_name", "pid", "started", "endpoints", "host", "finished", "world_size",
                          "ranks", "curve_public"})


def _whole_events(held: list, seq: int, first: dict[str, int]) -> list[list]:
    """Numbered held entries as whole events [topic, seq, tseq, t, ts, data]."""
    nxt, events, ts = dict(first), [], None
    for i, (topic, t, data, *has_ts) in enumerate(held):
        if has_ts:
            ts = has_ts[0]
        n = nxt[topic]
        nxt[topic] = n + 1
        events.append([topic, seq + i, n, t, ts, data if data is not None else {}])
    return events


def _valid_topic(topic: str) -> bool:
    return isinstance(topic, str) and bool(topic) and "\0" not in topic and not topic.startswith("_")


def _check_topic(topic: str) -> None:
    if not _valid_topic(topic):
        raise WireError(f"topic {topic!r} is empty, contains NUL or starts with '_' (reserved)")


def _topics_for(subscriptions) -> frozenset[str]:
    """The topics a set of SUB prefixes selects (b"" selects every topic)."""
    wanted: set[str] = set()
    for prefix in subscriptions:
        if prefix == _HB_PREFIX:
            continue
        if prefix.endswith(b"\0"):
            topic = prefix[:-1].decode(errors="replace")
            if _valid_topic(topic):  # publish() checks only topics outside `_wanted`
                wanted.add(topic)
        else:
            text = prefix.decode(errors="replace")
            wanted.update(t for t in RUN_TOPICS if t.startswith(text))
    return frozenset(wanted)
