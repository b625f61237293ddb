"""Held events: what the loop has published and not yet released, their numbering, and
the latest event of each topic that a late joiner's state carries.

Pure: no sockets. The publishing thread appends (`appender()`, the one code path that
adds a held event); whoever releases takes the queue and numbers it, under the outbox's
lock, which also orders the sends.
"""

from __future__ import annotations

import time
from collections import _count_elements, deque  # Counter's C helper: Counter() adds Python layers
from collections.abc import Callable
from itertools import repeat, starmap
from operator import itemgetter
from typing import Any

from offloop.bus.interest import Interest
from offloop.bus.wire import entry_ts

__all__ = ["HeldEvents", "HOLD_AT_MOST", "FOLD_AT_MOST", "whole_events"]

#: held events sent anyway once this many wait: by publish() at once, by the loop's
#: release_due() at its next step (held_publish() does not count)
HOLD_AT_MOST = 256
#: released bursts kept for the service thread to fold into the late-join state; past this
#: many the releasing thread folds them itself
FOLD_AT_MOST = 64
_TOPIC = itemgetter(0)  # a held entry's topic
_PLAIN = {str}  # the type of every topic a burst may carry as a map key (a set: checked in C)
_NO_TS = object()  # no held entry has this ts: the first one appended always carries its own


class HeldEvents:
    """The held queue, the run's sequence numbers, and each topic's latest event.

    An entry is (topic, t, data, ts), or (topic, t, data) when ts is the very object the
    entry before it had: a burst's own layout. A held event has no sequence number yet,
    so no heartbeat counts it. `seq` is the last sequence number spent, `tseq` each
    topic's; `latest` holds each topic's last numbered event [topic, seq, tseq, t, ts,
    data] once folded (`fold()`)."""

    def __init__(self) -> None:
        self.queue: deque[tuple] = deque()
        self.holding = False
        self.interval = 0.0  # release_due() sends only once this long after the last burst
        self.released_at = 0.0  # perf_counter() of the last release
        self.seq = 0
        self.tseq: dict[str, int] = {}
        self.latest: dict[str, list] = {}
        self._last_ts: list[Any] = [_NO_TS]  # the ts of the last entry appended, shared
        self._released_ts: Any = None  # the ts of the last entry released
        # released (seq, each topic's first tseq, each topic's count, entries) not yet
        # folded into `latest`: the service thread folds them, off the loop; a late
        # joiner's state folds them first
        self._unfolded: list[tuple[int, dict[str, int], dict[str, int], list]] = []

    def appender(self, interest: Interest) -> Callable[[str, tuple, dict | None], bool]:
        """The function that holds one event if `interest` wants its topic (opening it if
        an open prefix selects it); False otherwise. Made once: for a wanted topic it only
        reads the clock and appends, with no attribute lookup. From the publishing thread
        only: the ts check and the append must not interleave with another's."""
        wanted, last, clock, hold = interest.wanted, self._last_ts, time.time, self.queue.append

        def publish_held(topic: str, ts: tuple, data: dict | None = None) -> bool:
            if topic in wanted or (interest.open_prefixes and interest.opens(topic)):
                if ts is last[0]:
                    hold((topic, clock(), data))
                else:
                    last[0] = ts
                    hold((topic, clock(), data, ts))
                return True
            return False

        return publish_held

    def stalled(self, after: float) -> bool:
        """Held events not released for `after` seconds (or the interval, if longer)."""
        return self.holding and bool(self.queue) and \
            time.perf_counter() - self.released_at >= max(self.interval, after)

    def take(self, *, whole: bool) -> list:
        """Everything held now, for a release. `whole`, from the publishing thread (nothing
        appends meanwhile): copied, then cleared; otherwise popped one by one, in C, since
        the publishing thread may be appending."""
        queue = self.queue
        if whole:
            held = list(queue)
            queue.clear()
            return held
        return list(starmap(queue.popleft, repeat((), len(queue))))

    def advance(self, n: int) -> int:
        """Spend `n` sequence numbers; the first of them."""
        first = self.seq + 1
        self.seq += n
        return first

    def number(self, held: list) -> tuple[int, dict[str, int]]:
        """Number taken entries in publishing order: (the first one's seq, each topic's
        first tseq). Per topic rather than per event: the entries go out as they are; the
        latest of each topic, for late joiners, is found later (fold())."""
        self.released_at = time.perf_counter()
        if len(held[0]) == 3:  # its ts is the last one released (the entry before it)
            held[0] = (*held[0], self._released_ts)
        seq = self.advance(len(held))
        # counted in one C pass: list.count per topic is quadratic in a burst of many steps
        tseq, first, counts = self.tseq, {}, {}
        _count_elements(counts, map(_TOPIC, held))
        if {*map(type, counts)} != _PLAIN:  # an Event: no map key for the packer
            held[:] = [(str(entry[0]), *entry[1:]) for entry in held]
            counts = {}
            _count_elements(counts, map(_TOPIC, held))
        for topic, count in counts.items():
            n = tseq.get(topic, 0)
            first[topic] = n + 1
            tseq[topic] = n + count
        unfolded = self._unfolded
        # a release whose topics all come again in this one holds no topic's latest event:
        # dropped now rather than at the next fold, so a burst's entries live as long as
        # one burst interval, not until the service thread wakes (the garbage collector
        # goes through every young entry still alive each time it runs: docs/benchmarks.md)
        while unfolded and unfolded[-1][2].keys() <= counts.keys():
            unfolded.pop()
        unfolded.append((seq, first, counts, held))
        if len(self._unfolded) >= FOLD_AT_MOST:  # the service thread is late: bound what waits
            self.fold()
        self._released_ts = entry_ts(held, -1)
        return seq, first

    def number_one(self, topic: str, ts: tuple, data: dict | None) -> list:
        """A published-now event (not held), numbered after everything released before it;
        it is its topic's latest at once."""
        self.fold()  # what was released before this event is older than it
        topic = str(topic)  # an Event as its value
        seq = self.advance(1)
        n = self.tseq[topic] = self.tseq.get(topic, 0) + 1
        data = data if data is not None else {}
        event = self.latest[topic] = [topic, seq, n, time.time(), ts, data]
        return event

    @property
    def unfolded(self) -> bool:
        """Whether released events wait to be folded into `latest`."""
        return bool(self._unfolded)

    def fold(self) -> None:
        """Keep the latest event of each topic released since the last fold as a whole
        event, newest releases first; a release none of whose topics is still missing is
        not looked into (in a steady loop, every release but the newest)."""
        unfolded, latest, done = self._unfolded, self.latest, set()
        while unfolded:
            seq, first, counts, held = unfolded.pop()
            if done.issuperset(counts):
                continue
            # each topic's last entry
            last = dict(zip(map(_TOPIC, held), range(len(held)), strict=True))
            for topic, i in last.items():
                if topic not in done:
                    done.add(topic)
                    data = held[i][2]
                    latest[topic] = [topic, seq + i, first[topic] + counts[topic] - 1, held[i][1],
                                     entry_ts(held, i), data if data is not None else {}]


def whole_events(held: list, seq: int, first: dict[str, int]) -> list[list]:
    """Numbered held entries as whole events [topic, seq, tseq, t, ts, data]."""
    nxt, events, ts = dict(first), [], None
    for i, (topic, t, data, *has_ts) in enumerate(held):
        if has_ts:
            ts = has_ts[0]
        n = nxt[topic]
        nxt[topic] = n + 1
        events.append([topic, seq + i, n, t, ts, data if data is not None else {}])
    return events
