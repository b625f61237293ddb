"""Event messages and heartbeats (PUB/SUB): how one event is framed, encoded and decoded.
Promise: nothing is pickled; untrusted bytes decode within `Limits` or raise `WireError`.

Event message (PUB/SUB, one topic per Composer event)::

    frame 0   b"<topic>\\0" + msgpack array of 10, by position:
              [v = 2, kind = "ev", run: str, pub: str, rank: int,
               seq: int,        # per publisher, every message it sends
               tseq: int,       # per publisher and topic: gaps are counted on it
               t: float,        # wall time, seconds since the epoch
               ts: [epoch, batch, batch_in_epoch, sample, token],
               d: map]          # event-specific fields
    frame 1.. raw bytes of each tensor in d, C order, native little-endian

The envelope is positional because it is on every event: an array is cheaper to
decode than a map with the same fields. Everything rarer is a map.
A tensor inside ``d`` is the msgpack ext type 1 whose payload is the msgpack
array ``[frame_index, dtype, shape]``. Heartbeats travel on the topic ``_hb``.

The encoder is the publisher's one packer: its burst half is in `bursts`. Nothing is
pickled; a value the wire cannot carry raises `WireError`.
"""

from __future__ import annotations

import operator
import time
from typing import Any

import msgpack
import ormsgpack

from offloop.bus.errors import WireError
from offloop.bus.wire.bursts import BurstEncoding
from offloop.bus.wire.values import (
    BURST_TOPIC,
    BURSTS_OF_TOPICS,
    DEFAULT_LIMITS,
    HEARTBEAT_TOPIC,
    TENSOR_EXT,
    VERSION,
    Limits,
    Message,
    TensorFrame,
    _head_and_tensors,
    _is_tensor,
    _require,
    _shape,
    _tensor_bytes,
    _unpack,
    check_values,
    topic_prefix,
)

# ormsgpack packs events (benchmarks/bus.py, `floor_batched_ormsgpack_us`, what it saves).
# Whatever it would encode by a convention of its own (dataclasses, datetimes, UUIDs, enums)
# or refuse with a message of its own (ints past 64 bits) goes to EventEncoder._default
# instead, so the wire carries what msgpack's packer did and decoders read: nothing is
# converted silently.
_packb = ormsgpack.packb
_PACK_OPTIONS = (ormsgpack.OPT_PASSTHROUGH_BIG_INT | ormsgpack.OPT_PASSTHROUGH_DATACLASS
                 | ormsgpack.OPT_PASSTHROUGH_DATETIME | ormsgpack.OPT_PASSTHROUGH_ENUM
                 | ormsgpack.OPT_PASSTHROUGH_UUID)


class EventEncoder(BurstEncoding):
    """Encodes event messages for one publisher; owned by the publishing thread.

    The constant part of the envelope (version, kind, run, publisher, rank) is
    packed once per topic, so each event only packs what changes; a burst of events
    is packed in one call.
    """

    def __init__(self, run: str, pub: str, rank: int) -> None:
        self.run, self.pub, self.rank = run, pub, rank
        self._frames: list[memoryview] = []
        self._refused: str | None = None  # why _default refused a value (ormsgpack drops it)
        constant = msgpack.packb([VERSION, "ev", run, pub, rank])
        # fixarray header of 10 entries, then the 5 constant fields without their own header
        self._constant = b"\x9a" + constant[1:]
        self._prefixes: dict[str, bytes] = {}
        # fixarray header of 8 entries, then the 5 constant fields; burst() packs the other 3
        self._burst_head = (BURSTS_OF_TOPICS
                            + msgpack.packb([VERSION, "bu", run, pub, rank])[1:])

    def _default(self, value: Any) -> Any:
        """What ormsgpack hands back: tensors become frames, and what msgpack's own packer
        took (numpy scalars, int, float and str subclasses such as IntEnum, numpy.float64 and
        str Enums, tuple subclasses such as namedtuples) its plain value; anything else is
        refused."""
        try:
            if type(value) is TensorFrame:  # relayed as it arrived (a recorder re-framing an event)
                self._frames.append(value.data)
                return ormsgpack.Ext(TENSOR_EXT, msgpack.packb([len(self._frames), value.dtype,
                                                                list(value.shape)]))
            if _is_tensor(value):
                dtype, shape, view = _tensor_bytes(value)
                self._frames.append(view)
                return ormsgpack.Ext(TENSOR_EXT, msgpack.packb([len(self._frames), dtype, shape]))
            if hasattr(value, "item") and hasattr(value, "dtype"):  # numpy scalar
                return value.item()
            # IntEnum; a plain int here is past 64 bits
            if isinstance(value, int) and type(value) is not int:
                return operator.index(value)
            if isinstance(value, float):
                return float(value)
            if isinstance(value, str):  # a str Enum
                return str.__str__(value)
            if isinstance(value, tuple):
                return list(value)
            what = "an int past 64 bits" if isinstance(value, int) else type(value).__name__
            raise WireError(f"cannot encode {what} on the wire (not pickled, by design)")
        except Exception as exc:
            self._refused = str(exc)
            raise

    def _pack(self, value: Any) -> bytes:
        """`value` in msgpack; what the wire cannot carry (a type it does not know, an int
        past 64 bits, a dict key that is not a str, nesting deeper than 255) raises
        WireError."""
        try:
            return _packb(value, default=self._default, option=_PACK_OPTIONS)
        except TypeError as exc:  # ormsgpack.MsgpackEncodeError: _default's reason, if it refused
            why, self._refused = self._refused, None
            raise WireError(why or f"cannot encode the event: {exc}") from None

    def encode_body(self, seq: int, tseq: int, ts, data,
                    t: float | None = None) -> tuple[bytes, list | None]:
        """An event's variable fields (seq, tseq, t, ts, d) packed without their array
        header, and its tensor frames (None when it has none)."""
        frames = self._frames
        if frames:
            frames.clear()
        body = self._pack((seq, tseq, time.time() if t is None else t, ts, data))[1:]
        if frames:
            self._frames = []
            return body, frames
        return body, None

    def single(self, topic: str, body: bytes, tensors: list | None) -> list:
        """The frames of an event sent on its own; frame 0 starts with the topic prefix."""
        prefix = self._prefixes.get(topic)
        if prefix is None:
            prefix = self._prefixes[topic] = topic_prefix(topic) + self._constant
        return [prefix + body, *tensors] if tensors else [prefix + body]

    def encode(self, topic: str, seq: int, tseq: int, ts, data, t: float | None = None) -> list:
        """Frames for one event sent on its own."""
        return self.single(topic, *self.encode_body(seq, tseq, ts, data, t))

    def encode_event(self, event: list) -> list:
        """Frames for an event [topic, seq, tseq, t, ts, d] sent on its own."""
        topic, seq, tseq, t, ts, data = event
        return self.single(topic, *self.encode_body(seq, tseq, ts, data, t))


def event_frames(msg: Message) -> list:
    """The frames of `msg` as a message of its own: the frames it arrived in, or, for an
    event that came in a burst, the same fields framed again (tensors without a copy)."""
    if msg.raw is not None:
        return msg.raw
    return EventEncoder(msg.run, msg.pub, msg.rank).encode(msg.topic, msg.seq, msg.tseq,
                                                           msg.ts, msg.data, msg.t)


_HEARTBEAT_SCHEMA = {
    "k": str, "run": str, "pub": str, "rank": int, "seq": int, "tseq": dict, "t": (float, int),
    "beat": int, "final": bool, "drops": int, "interval": (float, int),
}


def decode_event(frames, limits: Limits = DEFAULT_LIMITS) -> Message:
    """Decode an event or heartbeat from its frames (bytes, memoryviews or zmq Frames); a
    burst is `decode_burst`'s."""
    head, tensor_frames = _head_and_tensors(frames, limits)
    cut = head.find(b"\0")
    if cut <= 0:
        raise WireError("frame 0 has no topic prefix (expected b'<topic>\\0' then the body)")
    try:
        topic = head[:cut].decode()
    except UnicodeDecodeError:
        raise WireError("topic is not UTF-8") from None
    if head[0] == 95:  # b"_": a reserved topic, of which only _hb is decoded here
        return _decode_heartbeat(topic, head[cut + 1 :], tensor_frames, limits)
    body = _unpack(head[cut + 1 :], limits, tensor_frames)
    if type(body) is not list or len(body) != 10:
        if isinstance(body, dict) and body.get("v") != VERSION or isinstance(body, list) and body \
                and body[0] != VERSION:
            version = body.get("v") if isinstance(body, dict) else body[0]
            raise WireError(f"wire version {version!r} is not supported "
                            f"(this build speaks {VERSION})")
        raise WireError(f"event body is {_shape(body)}, expected an array of 10 fields")
    v, k, run, pub, rank, seq, tseq, t, ts, d = body
    if v != VERSION:
        raise WireError(f"wire version {v!r} is not supported (this build speaks {VERSION})")
    if not (k == "ev" and type(run) is str and type(pub) is str and type(rank) is int
            and type(seq) is int and type(tseq) is int and type(t) is float and type(d) is dict
            and type(ts) is list and len(ts) == 5 and type(ts[0]) is int and type(ts[1]) is int
            and type(ts[2]) is int and type(ts[3]) is int and type(ts[4]) is int):
        _explain_event(body)
    if d:  # str keys only, no msgpack timestamp
        check_values(d)
    return Message(topic, k, run, pub, rank, seq, tseq, t, tuple(ts), d)


def _decode_heartbeat(topic: str, body: bytes, tensor_frames, limits: Limits) -> Message:
    """A heartbeat: frame 0 alone, ``_hb`` then a map (see encode_heartbeat)."""
    if topic != HEARTBEAT_TOPIC:
        raise WireError(f"topic {topic!r} is reserved (topics starting with '_' are the bus's own: "
                        f"{HEARTBEAT_TOPIC!r} here, {BURST_TOPIC!r} for decode_burst)")
    if tensor_frames is not None:
        raise WireError(f"a heartbeat is frame 0 alone; this one has {len(tensor_frames)} frames")
    body = _require(_unpack(body, limits), _HEARTBEAT_SCHEMA, "heartbeat")
    if body["k"] != "hb":
        raise WireError(f"heartbeat field 'k' is {body['k']!r}, expected 'hb'")
    for field, what in (("tseq", "topic"), ("refused", "kind")):
        counts = body.get(field, {})
        if type(counts) is not dict:
            raise WireError(f"heartbeat field {field!r} is {counts!r}, expected a map")
        for name, n in counts.items():
            if type(name) is not str or type(n) is not int:
                raise WireError(f"heartbeat field {field!r} maps {name!r} to {n!r}, "
                                f"expected {what} (str) -> int")
    check_values(body)
    return Message(topic, "hb", body["run"], body["pub"], body["rank"], body["seq"], 0,
                   float(body["t"]), (0, 0, 0, 0, 0), body)


_EVENT_FIELDS = (("v", int), ("kind", str), ("run", str), ("pub", str), ("rank", int),
                 ("seq", int), ("tseq", int), ("t", float), ("ts", list), ("d", dict))


def _explain_event(body: list) -> None:
    """Raise a WireError naming the first event field of the wrong type."""
    for (name, kind), value in zip(_EVENT_FIELDS, body, strict=True):
        if type(value) is not kind:
            raise WireError(f"event field {name!r} is {value!r}, expected {kind.__name__}")
        if name == "kind" and value != "ev":
            raise WireError(f"event field 'kind' is {value!r}, expected 'ev'")
    raise WireError(f"event field 'ts' is {body[8]!r}, expected 5 ints")


def encode_heartbeat(run: str, pub: str, rank: int, seq: int, tseq: dict[str, int],
                     drops: int, interval: float, beat: int, final: bool = False,
                     refused: dict[str, int] | None = None) -> bytes:
    """Heartbeat: ``b"_hb\\0" + {v, k: "hb", run, pub, rank, seq, tseq: {topic: n}, t,
    drops, interval, beat, final[, refused: {what: n}]}``: the latest sequence numbers make
    tail loss visible, `beat` counts heartbeats, `final` says the publisher is closing, and
    `refused` counts what the run's sockets refused from peers, by kind (left out when
    nothing was)."""
    body = {"v": VERSION, "k": "hb", "run": run, "pub": pub, "rank": rank, "seq": seq,
            "tseq": tseq, "t": time.time(), "drops": drops, "interval": interval, "beat": beat,
            "final": final}
    if refused:
        body["refused"] = refused
    return topic_prefix(HEARTBEAT_TOPIC) + msgpack.packb(body)
