"""Burst messages: several events of one publisher in one ZeroMQ message, for subscribers
of everything. Promise: nothing is pickled; untrusted bytes decode within `Limits` or
raise `WireError`.

Burst message (several events in one ZeroMQ message, for subscribers of everything)::

    frame 0   b"_burst\\0" + msgpack array of 8:
              [v = 2, kind = "bu", run: str, pub: str, rank: int,
               seq: int,                # the first event's; event i has seq + i
               tseq: {topic: int},      # each topic's first event's; its next ones count on
               events: [[topic, t, d], or [topic, t, d, ts], ...]]   # in publishing order
    frame 1.. the tensor frames of every event, event after event

A burst numbers its events instead of carrying seq and tseq in each, and an event
carries ``ts`` only where it differs from the event before it (the first always
carries it); ``d`` may be nil for an event without fields, so a step's events are cheaper to
pack and to decode (benchmarks/bus.py, `ratio_batched`). A burst's events have consecutive
``seq``: an event left out (a value the wire cannot carry) ends one burst and the
next starts after it.
Inside a burst, tensor descriptors number the burst's frames (1, 2, ... across all
its events), each frame used exactly once. A publisher
holding events sends them as one burst to subscribers of ``_burst`` (and to the empty
prefix, which selects everything) and as single messages to subscribers of their topic.
"""

from __future__ import annotations

from collections import Counter
from operator import itemgetter

from offloop.bus.errors import WireError
from offloop.bus.wire.values import (
    BURST_PREFIX,
    DEFAULT_LIMITS,
    VERSION,
    Limits,
    Message,
    _head_and_tensors,
    _shape,
    _unpack,
    check_values,
)


class BurstEncoding:
    """The burst half of `EventEncoder` (events.py), which owns what it packs with:
    `_pack`, the tensor frames it collects (`_frames`) and the burst's constant head."""

    def burst(self, seq: int, tseq: dict[str, int], entries: list, limits: Limits = DEFAULT_LIMITS
              ) -> list[list]:
        """Burst messages for `entries`, each (topic, t, d) or (topic, t, d, ts) in
        publishing order, the first with its ts, numbered from `seq` and, per topic, from
        `tseq[topic]`: one message, or several where one would pass the body, frame or
        message size limits. Raises WireError if an entry holds a value the wire cannot
        carry."""
        frames = self._frames
        if frames:
            frames.clear()
        body = self._pack((seq, tseq, entries))  # an array of 3: its 1-byte header goes
        if (len(body) + len(self._burst_head) > limits.max_body_bytes
                or len(frames) > limits.max_frames
                or frames and (sum(map(len, frames))
                               > limits.max_message_bytes - limits.max_body_bytes)):
            if len(entries) > 1:
                half = len(entries) // 2
                first, second = entries[:half], entries[half:]
                if len(second[0]) == 3:  # the second part's first entry carries its ts
                    second[0] = (*second[0], entry_ts(first, -1))
                counts = Counter(entry[0] for entry in first)
                return self.burst(seq, {topic: tseq[topic] for topic in counts}, first, limits) + \
                    self.burst(seq + half, {e[0]: tseq[e[0]] + counts.get(e[0], 0) for e in second},
                               second, limits)
        if frames:
            self._frames = []
            return [[self._burst_head + body[1:], *frames]]
        return [[self._burst_head + body[1:]]]

    def bursts(self, events: list[list], limits: Limits = DEFAULT_LIMITS) -> list[list]:
        """Burst messages for whole events ([topic, seq, tseq, t, ts, d] in publishing
        order): one burst per run of consecutive seq (and tseq), split further as burst()
        does. Raises WireError if an event holds a value the wire cannot carry
        (`split_unencodable()` finds which)."""
        out: list[list] = []
        for seq, tseq, entries in _runs(events):
            out.extend(self.burst(seq, tseq, entries, limits))
        return out

    def split_unencodable(self, events: list[list]) -> tuple[list[list], list[tuple[list, str]]]:
        """(the events the wire can carry, [(event, why) for each one it cannot]), each
        packed as deep as a burst holds it (msgpack limits nesting depth)."""
        good, bad = [], []
        for event in events:
            try:
                self._pack(((event,),))  # a burst's body, then its events array
            except Exception as exc:  # WireError; anything else the packer raises is a refusal too
                bad.append((event, str(exc)))
            else:
                good.append(event)
        self._frames = []
        return good, bad


def entry_ts(entries: list, i: int) -> tuple:
    """The ts of burst entry `i` ((topic, t, d) or (topic, t, d, ts)): its own, or that of
    the nearest entry before it that carries one (the first always does)."""
    while len(entries[i]) == 3:
        i -= 1
    return entries[i][3]


def _runs(events: list[list]) -> list[tuple[int, dict[str, int], list]]:
    """Whole events as (seq, tseq, entries) runs a burst can number: consecutive seq,
    and each topic's tseq consecutive; ts only where it changes."""
    runs: list[tuple[int, dict[str, int], list]] = []
    first: dict[str, int] = {}
    nxt: dict[str, int] = {}
    entries: list = []
    next_seq, last_ts = None, None
    for topic, seq, tseq, t, ts, data in events:
        if seq != next_seq or nxt.get(topic, tseq) != tseq:  # a new run starts here
            first, nxt, entries, last_ts = {}, {}, [], None
            runs.append((seq, first, entries))
        first.setdefault(topic, tseq)
        nxt[topic], next_seq = tseq + 1, seq + 1
        if last_ts is None or ts != last_ts:
            entries.append((topic, t, data, ts))
            last_ts = ts
        else:
            entries.append((topic, t, data))
    return runs


def decode_burst(frames, limits: Limits = DEFAULT_LIMITS) -> list[Message]:
    """Decode a burst message into its events, in publishing order, each numbered and
    timestamped as if it had come alone. The whole burst is refused (one WireError) if
    any part of it is malformed."""
    head, tensor_frames = _head_and_tensors(frames, limits)
    if not head.startswith(BURST_PREFIX):
        raise WireError("frame 0 of a burst must start with b'_burst\\0'")
    body = _unpack(head[len(BURST_PREFIX):], limits, tensor_frames)
    if type(body) is not list or len(body) != 8 or body[0] != VERSION:
        version = body[0] if isinstance(body, list) and body else None
        if isinstance(body, list) and body and version != VERSION:
            raise WireError(f"wire version {version!r} is not supported "
                            f"(this build speaks {VERSION})")
        raise WireError(f"burst body is {_shape(body)}, expected an array of 8 fields")
    _, kind, run, pub, rank, seq, tseq, events = body
    if not (kind == "bu" and type(run) is str and type(pub) is str and type(rank) is int
            and type(seq) is int and type(tseq) is dict and type(events) is list):
        raise WireError("burst header must be [2, 'bu', run: str, pub: str, rank: int, seq: int, "
                        "tseq: map, events: list]")
    for topic, n in tseq.items():  # every topic checked once here, not at each of its events
        if type(topic) is not str or not topic or topic[0] == "_" or "\0" in topic:
            raise WireError(f"burst topic {topic!r} is not a string, or empty, reserved (_...) "
                            "or has NUL")
        if type(n) is not int:
            raise WireError(f"burst tseq of {topic!r} is {n!r}, expected an int")
    nxt = dict(tseq)
    out = []
    append = out.append
    ts = None
    for ev in events:
        if type(ev) is not list or not 3 <= len(ev) <= 4:
            raise WireError(f"burst event is {_shape(ev)}, expected [topic, t, d] "
                            "or [topic, t, d, ts]")
        if len(ev) == 4:
            ts = ev[3]
            if not (type(ts) is list and len(ts) == 5 and type(ts[0]) is int and type(ts[1]) is int
                    and type(ts[2]) is int and type(ts[3]) is int and type(ts[4]) is int):
                raise WireError(f"burst event field 'ts' is {ts!r}, expected 5 ints")
            ts = tuple(ts)
        elif ts is None:
            raise WireError("the first event of a burst has no ts")
        topic, t, d = ev[0], ev[1], ev[2]
        n = nxt.get(topic) if type(topic) is str else None
        if n is None:
            raise WireError(f"burst event topic {topic!r} is not in the burst's tseq map")
        if type(t) is not float:
            raise WireError(f"burst event field 't' is {t!r}, expected float")
        if type(d) is not dict:
            if d is not None:
                raise WireError(f"burst event field 'd' is {_shape(d)}, expected a map or nil")
            d = {}
        nxt[topic] = n + 1
        append(Message(topic, "ev", run, pub, rank, seq, n, t, ts, d))
        seq += 1
    maps = list(filter(None, map(_D, events)))  # every non-empty d, collected in C
    if maps:
        check_values(maps)  # str keys and no msgpack timestamp, in every d at once
    return out


_D = itemgetter(2)  # a burst event's d
