"""The publisher's outbox: the one socket events and heartbeats leave by, its lock, and
the bounds on what may wait in it (a full queue, or the byte bound, is a counted drop).

Whoever sends takes `lock` first: the loop releasing its held events, the service thread
releasing stalled ones or beating. The lock also orders numbering with sending, so no
heartbeat announces an event that has not left.
"""

from __future__ import annotations

import logging
import threading
from collections import deque

import zmq

from offloop.bus.held import whole_events
from offloop.bus.interest import Interest
from offloop.bus.publisher_stats import PublisherStats
from offloop.bus.wire import EventEncoder, Limits, encode_heartbeat

__all__ = ["Outbox", "TRACKED_BYTES", "TRACK_SHARE"]

log = logging.getLogger("offloop.bus")

#: events messages this large or larger are counted against max_queued_bytes until libzmq
#: has handed them to every subscriber's connection; smaller ones (a step's burst on a
#: model of real size is 1-2 KiB) are bounded by the subscriber queue's message count alone
TRACKED_BYTES = 4096
#: a counted message of one frame under 64 KiB (a burst of fast steps) is copied and sent
#: untracked: a tracker wakes pyzmq's garbage-collector thread, which takes the GIL from
#: the loop (benchmarks/trainer_overhead.py, `ratio_bus_on_mean`). One is tracked whenever
#: 1/TRACK_SHARE of max_queued_bytes has gone untracked; its tracker stands for those
#: before it too, as every connection takes messages in order
TRACK_SHARE = 64
_DRAIN_EVERY = 4096  # sends between drains of the sending socket's copy of subscriptions


class Outbox:
    """Sends events messages and heartbeats down the inproc pipe to the proxy.

    `max_queued_bytes` bounds large messages (TRACKED_BYTES or more) not yet written to
    every subscriber's connection: one more is dropped and counted in `stats.drops` and
    `stats.byte_drops`. Every method but connect() and close() runs under `lock`."""

    def __init__(self, encoder: EventEncoder, limits: Limits, stats: PublisherStats,
                 max_queued_bytes: int, heartbeat_interval: float) -> None:
        self.lock = threading.Lock()
        self.encoder, self.limits, self.stats = encoder, limits, stats
        self.max_queued_bytes = max_queued_bytes
        self.heartbeat_interval = heartbeat_interval
        self._sock: zmq.Socket | None = None
        self._sends = 0
        # trackers not yet done, each with the bytes it releases (its own and the untracked
        # messages sent before it), and the bytes sent untracked since the last tracker
        self._in_flight: deque[tuple[zmq.MessageTracker, int]] = deque()
        self._untracked = 0

    def connect(self, ctx: zmq.Context, endpoint: str, queue_size: int) -> None:
        """The sending socket: an XPUB whose full pipe refuses a send (NODROP) at once."""
        sock = ctx.socket(zmq.XPUB)
        sock.setsockopt(zmq.XPUB_NODROP, 1)
        sock.sndhwm = queue_size
        sock.linger = 0
        sock.connect(endpoint)
        self._sock = sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)

    def send_released(self, held: list, seq: int, first: dict[str, int],
                      interest: Interest) -> None:
        """Send numbered held entries: as bursts if anyone takes bursts, and each event of
        a singly subscribed topic as a message of its own. An event the wire cannot carry
        is counted in `stats.unencodable`, logged, and left out. Never raises."""
        encoder, events = self.encoder, None  # the whole events, made only where needed
        if interest.bursts:
            try:
                bursts = encoder.burst(seq, first, held, self.limits)
            except Exception:  # one event the wire cannot carry: leave it out, send the rest
                events = self._encodable(whole_events(held, seq, first))
                try:
                    bursts = encoder.bursts(events, self.limits) if events else []
                except Exception:  # not found one by one: none is sent, every one counted
                    self._encodable(events, everything=True)
                    events, bursts = [], []
            for frames in bursts:
                self.send(frames)
        single = interest.single
        if single:
            for event in events if events is not None else whole_events(held, seq, first):
                if event[0] in single:
                    try:
                        frames = encoder.encode_event(event)
                    except Exception:
                        self._encodable([event])
                        continue
                    self.send(frames)

    def send_now(self, event: list, interest: Interest) -> bool:
        """Send one numbered event that was not held; raises WireError if the wire cannot
        carry it. False if any message of it was dropped."""
        sent = True
        if event[0] in interest.single:
            sent = self.send(self.encoder.encode_event(event))
        if interest.bursts:
            for frames in self.encoder.bursts([event], self.limits):
                sent = self.send(frames) and sent
        return sent

    def beat(self, seq: int, tseq: dict[str, int], beats: int, final: bool = False,
             refused: dict[str, int] | None = None) -> None:
        """One heartbeat down the events' own pipe: it leaves behind every event numbered
        before it, so no subscriber sees it overtake events it announces."""
        encoder = self.encoder
        beat = encode_heartbeat(encoder.run, encoder.pub, encoder.rank, seq, dict(tseq),
                                self.stats.drops, self.heartbeat_interval, beats, final, refused)
        try:
            self._sock.send(beat, zmq.NOBLOCK)
        except zmq.Again:  # the queue is full of events: the next heartbeat says it all
            pass

    def send(self, frames: list) -> bool:
        """Send one message; a full queue, or the byte bound, drops and counts it."""
        self._sends += 1
        if self._sends % _DRAIN_EVERY == 0:
            self._drain_subscriptions()
        try:
            if len(frames) == 1:
                size = len(frames[0])
                if size < TRACKED_BYTES:  # the usual message: small, copied
                    self._sock.send(frames[0], zmq.NOBLOCK)
                    return True
                # copied below pyzmq's own line between copying and zero-copy (64 KiB)
                if size < zmq.COPY_THRESHOLD and \
                        self._untracked + size < self.max_queued_bytes // TRACK_SHARE:
                    return self._send_counted(frames[0], size)
            else:
                size = sum(f.nbytes if isinstance(f, memoryview) else len(f) for f in frames)
                if size < TRACKED_BYTES:
                    self._sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
                    return True
            return self._send_tracked(frames, size)
        except zmq.Again:
            self.stats.drops += 1
            return False

    def _has_room(self, size: int) -> bool:
        """Whether a counted message of `size` bytes fits under max_queued_bytes, once the
        messages whose trackers are done are taken off; if not, it is dropped and counted."""
        in_flight, stats = self._in_flight, self.stats
        while in_flight and in_flight[0][0].done:
            stats.queued_bytes -= in_flight.popleft()[1]
        if stats.queued_bytes + size <= self.max_queued_bytes:
            return True
        stats.drops += 1
        stats.byte_drops += 1
        if stats.byte_drops == 1 or stats.byte_drops % 1000 == 0:
            log.warning("offloop: an events message of %d bytes was dropped (%d so far): %d "
                        "bytes of messages still wait for a subscriber that is not reading "
                        "(max_queued_bytes %d)", size, stats.byte_drops, stats.queued_bytes,
                        self.max_queued_bytes)
        return False

    def _send_counted(self, frame: bytes, size: int) -> bool:
        """A counted message of one frame, copied and untracked: it stays in `queued_bytes`
        until the next tracked message's tracker is done."""
        if not self._has_room(size):
            return False
        self._sock.send(frame, zmq.NOBLOCK)
        self.stats.queued_bytes += size
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
        self._sock.send_multipart([*frames[:-1], last], zmq.NOBLOCK, copy=False)
        self._in_flight.append((last.tracker, size + self._untracked))
        self.stats.queued_bytes += size
        self._untracked = 0
        return True

    def _encodable(self, events: list[list], everything: bool = False) -> list[list]:
        """The events the wire can carry; the others are counted and logged (all of
        them with `everything`: a batch that failed as a whole)."""
        if everything:
            good, bad = [], [(event, "its burst could not be encoded") for event in events]
        else:
            good, bad = self.encoder.split_unencodable(events)
        for event, why in bad:
            self.stats.unencodable += 1
            if self.stats.unencodable == 1 or self.stats.unencodable % 1000 == 0:
                log.warning("offloop: %s event not sent (%d so far): %s", event[0],
                            self.stats.unencodable, why)
        return good

    def _drain_subscriptions(self) -> None:
        """The sending XPUB queues a copy of each subscription change; the service thread
        tracks them from its own socket, so these are only discarded."""
        try:
            while True:
                self._sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            pass
