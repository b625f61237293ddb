"""Subscriber: the client half of the ZeroMQ Guide's Clone pattern, with heartbeats.

Promise: every lost message is counted (per-topic sequence numbers, tail loss from
heartbeats), the late-join state comes first and nothing older than it is delivered
again, and a publisher that falls silent is reported, never waited on forever. A
subscriber told to wait out a silence (`give_up_after`) takes the state again when the
heartbeats come back and folds in only what it lost, so the counts stay exact.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import zmq

from offloop.bus.errors import PublisherSilent, WireError
from offloop.bus.wire import (
    BURST_PREFIX,
    BURST_TOPIC,
    BURSTS_OF_TOPICS,
    DEFAULT_LIMITS,
    HEARTBEAT_TOPIC,
    Limits,
    Message,
    decode_burst,
    decode_event,
    decode_reply,
    encode_request,
    topic_prefix,
    want_prefix,
)

__all__ = ["Subscriber", "JoinState", "SubscriberStats"]


@dataclass
class JoinState:
    """What a late joiner receives first: the run config and the latest message per topic."""

    run: str
    pub: str
    config: dict[str, Any]
    entries: list[Message]
    seq: int


@dataclass
class SubscriberStats:
    received: int = 0
    gaps: int = 0
    duplicates: int = 0
    malformed: int = 0
    heartbeats: int = 0
    gaps_by_topic: dict[str, int] = field(default_factory=dict)
    #: silences longer than the heartbeat timeout that were waited out (partitions)
    silences: int = 0
    #: late-join states taken again after a silence, and those that did not come in time
    resyncs: int = 0
    resync_failures: int = 0
    #: entries of those states delivered (from_state): the latest value of a topic whose
    #: newest events were lost; never counted as received
    resynced: int = 0


class Subscriber:
    """Receives one publisher's events; `connect()` joins, `recv()` delivers in order."""

    def __init__(
        self,
        events: str,
        state: str | None = None,
        *,
        topics: Iterable[str] | None = None,
        heartbeat_timeout: float = 5.0,
        give_up_after: float | None = None,
        settle: float = 0.0,
        rcvhwm: int = 10_000,
        limits: Limits = DEFAULT_LIMITS,
        context: zmq.Context | None = None,
        curve=None,
    ) -> None:
        self.events_endpoint, self.state_endpoint = events, state
        self.topics = None if topics is None else frozenset(str(t) for t in topics)
        for topic in self.topics or ():
            topic_prefix(topic)  # a topic the wire cannot carry is named now, not at connect()
        self.heartbeat_timeout = heartbeat_timeout
        # seconds of silence before recv() raises PublisherSilent; between the heartbeat
        # timeout and this, the publisher counts as cut off (`silent_since`) and is waited for
        if give_up_after is not None and give_up_after < heartbeat_timeout:
            raise ValueError(f"give_up_after must be >= heartbeat_timeout ({heartbeat_timeout:g}), "
                             f"got {give_up_after!r}")
        self.give_up_after = heartbeat_timeout if give_up_after is None else give_up_after
        #: monotonic time the publisher was last heard, while a silence is being waited out
        self.silent_since: float | None = None
        #: seconds the last silence lasted, from the last message before it to the first after
        self.last_silence = 0.0
        # seconds a heartbeat waits before its loss is counted: none is needed, since a
        # heartbeat cannot overtake the events it announces (they share one pipe); a
        # subscriber of several publishers' streams through a relay may want a margin
        self.settle = settle
        self.limits = limits
        self.stats = SubscriberStats()
        self.finished = False
        self.join_state: JoinState | None = None
        self.publisher_drops = 0
        #: what the run's sockets refused from peers, by kind (its latest heartbeat's)
        self.publisher_refused: dict[str, int] = {}
        self._own_context = context is None
        self._ctx = context or zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.rcvhwm = rcvhwm
        self._sub.linger = 0
        self._sub.maxmsgsize = limits.max_message_bytes
        self._curve = curve  # bus.security.ClientKeys, for a trainer that has keys
        if curve is not None:
            curve.apply(self._sub)
        self._pending: deque[Message] = deque()
        self._last: dict[tuple[str, str], int] = {}
        self._known_pubs: set[str] = set()  # publishers whose full topic list we have seen
        self._beats: deque[tuple[float, Message]] = deque()
        self._last_heard = time.monotonic()
        self._latest_beat = 0
        self._final_at: float | None = None
        self._joined = False
        self._resync_due = False
        # per (pub, topic): the newest run of lost tseqs (first, last), merged when runs touch;
        # a resync entry inside it, at the stream's end, is a value this subscriber never got
        self._lost_tail: dict[tuple[str, str], tuple[int, int]] = {}
        # resync entries newer than the stream so far: delivered once the stream reaches them
        # and they prove lost, dropped once a live event as new arrives
        self._awaiting: dict[tuple[str, str], Message] = {}
        # the publisher's heartbeat count when the last resync's state was taken, and the
        # newest heartbeat whose tail loss has been counted: past it, the silence is paid for
        self._resync_beat = 0
        self._settled_beat = 0

    # ------------------------------------------------------------ joining

    def connect(self, join_timeout: float = 2.0) -> JoinState | None:
        """Subscribe, wait for the first heartbeat, and take the late-join state if a
        state endpoint was given. Raises PublisherSilent if nothing answers in time."""
        if self.topics is None:  # everything, as bursts: one message per burst of events
            self._sub.subscribe(topic_prefix(BURST_TOPIC))
            self._sub.subscribe(topic_prefix(HEARTBEAT_TOPIC))  # last: it proves the rest arrived
        else:  # its topics, in the same bursts: one message per burst still
            for topic in sorted(self.topics):
                self._sub.subscribe(want_prefix(topic))
            self._sub.subscribe(BURSTS_OF_TOPICS)
            self._sub.subscribe(topic_prefix(HEARTBEAT_TOPIC))  # last: it proves the rest arrived
        self._sub.connect(self.events_endpoint)
        deadline = time.monotonic() + join_timeout
        if self.state_endpoint is None:
            while not self._latest_beat:
                self._pump(deadline)
            self._last_heard = time.monotonic()
            self._joined = True
            return None
        while True:
            state, beat = self._request_state(deadline)
            wait_until = min(deadline, time.monotonic() + 0.03)
            while self._latest_beat < beat and time.monotonic() < wait_until:
                self._pump(wait_until, raise_on_deadline=False)
            if self._latest_beat >= beat:
                break  # our subscription was live before the state was taken
        self._apply_state(state)
        self._last_heard = time.monotonic()
        self._joined = True
        return self.join_state

    def _request_state(self, deadline: float) -> tuple[list, int]:
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.linger = 0
        dealer.maxmsgsize = self.limits.max_message_bytes
        if self._curve is not None:
            self._curve.apply(dealer)
        try:
            dealer.connect(self.state_endpoint)
            topics = None if self.topics is None else sorted(self.topics)
            dealer.send(encode_request("state_req", topics=topics))
            while not dealer.poll(10):
                self._pump(min(deadline, time.monotonic() + 0.01), raise_on_deadline=False)
                if time.monotonic() >= deadline:
                    raise PublisherSilent(
                        f"no late-join state from {self.state_endpoint} within the join timeout"
                    )
            frames = dealer.recv_multipart(copy=False)
        finally:
            dealer.close()
        header = decode_reply(frames[0], self.limits)
        if header["k"] != "state":
            raise WireError(f"state request answered with {header['k']!r}: {header.get('error')}")
        return [header, frames[1:]], header["beat"]

    def _apply_state(self, state: list) -> None:
        header, entries = self._decode_state(state)
        pub, tseqs = header["pub"], header["tseq"]
        self._known_pubs.add(pub)
        for topic, tseq in tseqs.items():
            if self._selected(topic):
                key = (pub, topic)
                self._last[key] = max(self._last.get(key, 0), tseq)
        # drop whatever arrived on the stream before the state and is not newer than it
        self._pending = deque(m for m in self._pending
                              if m.tseq > self._last.get((m.pub, m.topic), 0))
        for entry in entries:
            entry.from_state = True
        self._pending.extendleft(reversed(entries))
        self.join_state = JoinState(header["run"], pub, header["config"], entries, header["seq"])

    def _decode_state(self, state: list) -> tuple[dict, list[Message]]:
        """A state reply's header (its `tseq` checked) and entries; WireError if malformed."""
        header, frames = state
        entries, at = [], 0
        for count in header["entries"]:
            if not isinstance(count, int) or count < 1 or at + count > len(frames):
                raise WireError(f"late-join state lists an entry of {count!r} frames")
            entry = decode_event(frames[at : at + count], self.limits)
            entry.raw = [f.bytes if hasattr(f, "bytes") else f for f in frames[at : at + count]]
            entries.append(entry)
            at += count
        tseqs = header["tseq"]
        if not isinstance(tseqs, dict) or not all(
                isinstance(t, str) and isinstance(n, int) and not isinstance(n, bool)
                for t, n in tseqs.items()):
            raise WireError("late-join state field 'tseq' must map topic names to integers")
        return header, entries

    # ---------------------------------------------------------- receiving

    def recv(self, timeout: float | None = None) -> Message | None:
        """The next event, or None after `timeout` seconds (or once the publisher has
        finished). Raises PublisherSilent when no heartbeat came within the timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._pending:
            if self.finished:
                return None
            if self._resync_due:
                self._resync()
                continue
            if not self._pump(deadline, raise_on_deadline=False):
                return None
        return self._pending.popleft()

    def _resync(self) -> None:
        """After a silence, take the state again and fold in what the silence cost us.
        Only `_pending` changes: `_last` and the counters stay as the stream made them, so
        received + gaps still equals what was published, and no event is delivered twice."""
        self._resync_due = False
        if self.state_endpoint is None or self._final_at is not None:  # nothing to ask, or closing
            return
        try:
            state, beat = self._request_state(time.monotonic() + self.heartbeat_timeout)
            header, entries = self._decode_state(state)
        except (PublisherSilent, WireError):
            self.stats.resync_failures += 1
            return
        self.stats.resyncs += 1
        self._resync_beat = beat
        pub = header["pub"]
        for entry in entries:
            key = (pub, entry.topic)
            last = self._last.get(key, 0)
            entry.from_state = True
            if entry.tseq > last:  # still on its way, or about to prove lost
                self._awaiting[key] = entry
            elif self._lost(key, entry.tseq):
                self._deliver_resynced(entry)

    def _lost(self, key: tuple[str, str], tseq: int) -> bool:
        """Whether `tseq` was counted lost and nothing newer of its topic was received."""
        run = self._lost_tail.get(key)
        return run is not None and run[1] == self._last.get(key) and run[0] <= tseq <= run[1]

    @property
    def recovering(self) -> bool:
        """Heard again after a silence, and its state not yet taken or its backlog not yet
        counted: what the silence cost is not known yet."""
        return self._resync_due or self.catching_up

    @property
    def catching_up(self) -> bool:
        """After a resync, until a heartbeat sent after its state was taken has been
        counted: until then, events sent during the silence may still arrive or prove lost."""
        return self._settled_beat <= self._resync_beat and self._resync_beat > 0

    @property
    def resync_waiting(self) -> int:
        """Entries of the last resync still waiting for the stream to reach them."""
        return len(self._awaiting)

    def _deliver_resynced(self, entry: Message) -> None:
        self.stats.resynced += 1
        self._pending.append(entry)

    def _pump(self, deadline: float | None, raise_on_deadline: bool = True) -> bool:
        """Receive and process one message into the pending queue; False on deadline."""
        while True:
            if self._beats or self._final_at is not None:
                self._settle_beats()
                if self.finished and not self._pending:
                    return False
            try:  # the hot path: a message is already waiting
                frames = [self._sub.recv(zmq.NOBLOCK)]
            except zmq.Again:
                pass
            else:
                while self._sub.get(zmq.RCVMORE):
                    frames.append(self._sub.recv(copy=False))
                self._take(frames)
                return True
            now = time.monotonic()
            # while joining, the join deadline is the only limit
            silence = self._last_heard + self.heartbeat_timeout if self._joined else float("inf")
            if now >= silence and not self.finished:
                silence = self._last_heard + self.give_up_after
                if now >= silence:
                    raise PublisherSilent(
                        f"no heartbeat from {self.events_endpoint} for {self.give_up_after:g}s"
                    )
                if self.silent_since is None:  # cut off, or gone: waited for until give_up_after
                    self.silent_since = self._last_heard
                    self.stats.silences += 1
            if deadline is not None and now >= deadline:
                if raise_on_deadline:
                    raise PublisherSilent(
                        f"nothing from {self.events_endpoint} within the join timeout"
                    )
                return False
            wake = silence if deadline is None else min(deadline, silence)
            wake = min(wake, now + 3600)
            if self._beats or self._final_at is not None:
                wake = min(wake, now + self.settle / 2)
            self._sub.poll(max(0.0, wake - now) * 1000)

    def _take(self, frames: list) -> None:
        burst = frames[0].startswith(BURST_PREFIX)
        try:
            if burst:
                msgs = decode_burst(frames, self.limits)
            else:
                msg = decode_event(frames, self.limits)
        except WireError:
            self.stats.malformed += 1  # its events are counted lost by the next heartbeats
            return
        self._last_heard = time.monotonic()
        if self.silent_since is not None:  # heard again: what came before is in order behind us
            self.last_silence = self._last_heard - self.silent_since
            self.silent_since = None
            self._resync_due = True
        if burst:
            topics = self.topics  # a burst holds the topics of every subscriber: ours are kept
            for msg in msgs:
                if topics is None or msg.topic in topics:
                    self._accept(msg)
            return
        if msg.topic == HEARTBEAT_TOPIC:  # not msg.kind: an event's kind field is only a string
            self.stats.heartbeats += 1
            self._latest_beat = max(self._latest_beat, msg.data.get("beat", 0))
            self.publisher_drops = msg.data.get("drops", 0)
            self.publisher_refused = msg.data.get("refused", {})
            self._beats.append((self._last_heard, msg))
            if msg.data.get("final") and self._final_at is None:
                self._final_at = self._last_heard
            return
        msg.raw = frames
        self._accept(msg)

    def _accept(self, msg: Message) -> None:
        """Deliver an event unless it is a duplicate; count the gap before it."""
        key = (msg.pub, msg.topic)
        last = self._last.get(key, 0 if msg.pub in self._known_pubs else None)
        if last is not None:
            if msg.tseq <= last:
                self.stats.duplicates += 1
                return
            if msg.tseq > last + 1:
                self._count_gap(key, last + 1, msg.tseq - 1)
        self._last[key] = msg.tseq
        self.stats.received += 1
        self._pending.append(msg)
        if self._awaiting and key in self._awaiting and msg.tseq >= self._awaiting[key].tseq:
            del self._awaiting[key]  # the stream brought it, or something newer

    def _settle_beats(self) -> None:
        """Count tail loss against heartbeats old enough that nothing sent before them
        can still be in flight."""
        cutoff = time.monotonic() - self.settle
        while self._beats and self._beats[0][0] <= cutoff:
            _, beat = self._beats.popleft()
            number = beat.data.get("beat", 0)
            if isinstance(number, int) and number > self._settled_beat:
                self._settled_beat = number
            for topic, tseq in beat.data["tseq"].items():
                if not isinstance(tseq, int) or not self._selected(topic):
                    continue
                key = (beat.pub, topic)
                last = self._last.get(key, 0 if beat.pub in self._known_pubs else None)
                if last is None:
                    self._last[key] = tseq  # first sight of this topic: the baseline
                elif tseq > last:
                    self._count_gap(key, last + 1, tseq)
                    self._last[key] = tseq
                    entry = self._awaiting.get(key)
                    if entry is not None and entry.tseq <= tseq:
                        # it proved lost: its value is news
                        del self._awaiting[key]
                        self._deliver_resynced(entry)
            self._known_pubs.add(beat.pub)
        if self._final_at is not None and self._final_at <= cutoff and not self._beats:
            self.finished = True

    def _count_gap(self, key: tuple[str, str], first: int, last: int) -> None:
        """Count tseqs first..last of `key` lost, and remember the newest run of losses."""
        n, topic = last - first + 1, key[1]
        self.stats.gaps += n
        self.stats.gaps_by_topic[topic] = self.stats.gaps_by_topic.get(topic, 0) + n
        run = self._lost_tail.get(key)
        self._lost_tail[key] = (run[0] if run is not None and run[1] + 1 == first else first, last)

    def _selected(self, topic: str) -> bool:
        return self.topics is None or topic in self.topics

    def close(self) -> None:
        self._sub.close(linger=0)
        if self._own_context:
            self._ctx.term()

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
