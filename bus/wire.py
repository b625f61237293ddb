"""Wire format v2: msgpack bodies, raw tensor frames, bounded decoding.

Follows the ZeroMQ Guide's KVMsg: every message is documented frame by frame
here (and in docs/protocol.md). Nothing is pickled, and untrusted bytes either
decode within fixed limits or raise `WireError` — never anything else.

Event message (PUB/SUB, one topic per Composer event)::

    frame 0   b"<topic>\\0" + msgpack array of 10, by position:
              [v = 2, kind = "ev", run: str, pub: str, rank: int,
               seq: int,        # per publisher, every message it sends
               tseq: int,       # per publisher and topic: gaps are counted on it
               t: float,        # wall time, seconds since the epoch
               ts: [epoch, batch, batch_in_epoch, sample, token],
               d: map]          # event-specific fields
    frame 1.. raw bytes of each tensor in d, C order, native little-endian

The envelope is positional because it is on every event: decoding an array costs
half what a map with the same fields does. Everything rarer is a map.
A tensor inside ``d`` is the msgpack ext type 1 whose payload is the msgpack
array ``[frame_index, dtype, shape]``. Heartbeats travel on the topic ``_hb``.

Burst message (several events in one ZeroMQ message, for subscribers of everything)::

    frame 0   b"_burst\\0" + msgpack array of 8:
              [v = 2, kind = "bu", run: str, pub: str, rank: int,
               seq: int,                # the first event's; event i has seq + i
               tseq: {topic: int},      # each topic's first event's; its next ones count on
               events: [[topic, t, d], or [topic, t, d, ts], ...]]   # in publishing order
    frame 1.. the tensor frames of every event, event after event

A burst numbers its events instead of carrying seq and tseq in each, and an event
carries ``ts`` only where it differs from the event before it (the first always
carries it); ``d`` may be nil for an event without fields. That halves what a
step's events cost to pack and to decode. A burst's events have consecutive
``seq``: an event left out (a value the wire cannot carry) ends one burst and the
next starts after it.
Inside a burst, tensor descriptors number the burst's frames (1, 2, ... across all
its events), each frame used exactly once. A publisher
holding events sends them as one burst to subscribers of ``_burst`` (and to the empty
prefix, which selects everything) and as single messages to subscribers of their topic.
The late-join state, control requests and acks are documented with their
encoders below.
"""

from __future__ import annotations

import math
import operator
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import msgpack
import ormsgpack

from offloop.bus.errors import WireError

__all__ = [
    "VERSION",
    "HEARTBEAT_TOPIC",
    "BURST_TOPIC",
    "WireError",
    "Limits",
    "TensorFrame",
    "Message",
    "EventEncoder",
    "decode_event",
    "decode_burst",
    "event_frames",
    "encode_heartbeat",
    "encode_request",
    "decode_request",
    "encode_reply",
    "decode_reply",
    "topic_prefix",
]

VERSION = 2
HEARTBEAT_TOPIC = "_hb"
BURST_TOPIC = "_burst"
BURST_PREFIX = b"_burst\0"
TENSOR_EXT = 1

# Events are packed by ormsgpack (about a third of msgpack's Packer's instructions for a
# burst of small values, on the training thread). Whatever it would encode by a
# convention of its own (dataclasses, datetimes, UUIDs, enums) or refuse with a message
# of its own (ints past 64 bits) goes to EventEncoder._default instead, so the wire
# carries what msgpack's packer did and decoders read: nothing is converted silently.
_packb = ormsgpack.packb
_PACK_OPTIONS = (ormsgpack.OPT_PASSTHROUGH_BIG_INT | ormsgpack.OPT_PASSTHROUGH_DATACLASS
                 | ormsgpack.OPT_PASSTHROUGH_DATETIME | ormsgpack.OPT_PASSTHROUGH_ENUM
                 | ormsgpack.OPT_PASSTHROUGH_UUID)

#: Bytes per element of every dtype a tensor frame may carry.
DTYPE_SIZES = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
}


@dataclass(frozen=True)
class Limits:
    """Bounds applied to untrusted bytes before and while decoding them."""

    max_body_bytes: int = 4 << 20
    max_frames: int = 64
    max_message_bytes: int = 256 << 20
    max_container_len: int = 100_000

DEFAULT_LIMITS = Limits()


def topic_prefix(topic: str) -> bytes:
    """The bytes a SUB socket subscribes to for exactly this topic."""
    if "\0" in topic or not topic:
        raise WireError(f"topic {topic!r} is empty or contains NUL")
    return topic.encode() + b"\0"


# --------------------------------------------------------------------- tensors


@dataclass(frozen=True)
class TensorFrame:
    """A tensor as it came off the wire: dtype name, shape and its raw bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: memoryview | bytes

    @property
    def nbytes(self) -> int:
        return len(self.data)

    def to_numpy(self):
        import numpy as np

        if self.dtype == "bfloat16":
            raise WireError("bfloat16 has no numpy dtype; use to_torch()")
        return np.frombuffer(self.data, dtype=self.dtype).reshape(self.shape)

    def to_torch(self):
        """A writable torch tensor holding a copy of the bytes."""
        import torch

        dtype = getattr(torch, self.dtype)
        copy = bytearray(self.data)
        if not copy:
            return torch.empty(self.shape, dtype=dtype)
        return torch.frombuffer(copy, dtype=dtype).reshape(self.shape)


def _tensor_bytes(value: Any) -> tuple[str, tuple[int, ...], memoryview]:
    """Dtype, shape and a zero-copy view of a CPU torch tensor or numpy array."""
    if hasattr(value, "detach"):  # torch.Tensor, checked by duck type: bus never imports torch
        t = value.detach()
        if t.device.type != "cpu":
            raise WireError(
                f"tensor on {t.device} cannot be published: stage it to CPU (non_blocking) first"
            )
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in DTYPE_SIZES:
            raise WireError(f"tensor dtype {dtype} is not supported on the wire")
        if not t.is_contiguous():
            t = t.contiguous()
        shape = tuple(t.shape)
        if dtype == "bfloat16":
            import torch

            t = t.view(torch.int16)
        return dtype, shape, _flat_view(t.numpy())
    dtype = str(value.dtype)
    if dtype not in DTYPE_SIZES:
        raise WireError(f"array dtype {dtype} is not supported on the wire")
    arr = value if value.flags.c_contiguous else value.copy(order="C")
    return dtype, tuple(arr.shape), _flat_view(arr)


def _flat_view(arr) -> memoryview:
    """The array's bytes as a flat view, without copying them."""
    if arr.size == 0:
        return memoryview(b"")
    return memoryview(arr.reshape(-1)).cast("B")


def _is_tensor(value: Any) -> bool:
    """A torch tensor or a numpy array (numpy scalars have no __setitem__ and travel as numbers)."""
    return hasattr(value, "dtype") and hasattr(value, "shape") and (
        hasattr(value, "detach") or hasattr(value, "__setitem__")
    )


# ---------------------------------------------------------------------- events


@dataclass(slots=True)
class Message:
    """A decoded event or heartbeat; `data` holds the event-specific fields."""

    topic: str
    kind: str
    run: str
    pub: str
    rank: int
    seq: int
    tseq: int
    t: float
    ts: tuple[int, int, int, int, int]
    data: dict[str, Any] = field(default_factory=dict)
    from_state: bool = False
    raw: list | None = None  # the frames it was decoded from (kept by subscribers, for recorders)


class EventEncoder:
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
        self._burst_head = BURST_PREFIX + b"\x98" + msgpack.packb([VERSION, "bu", run, pub, rank])[1:]

    def _default(self, value: Any) -> Any:
        """What ormsgpack hands back: tensors become frames, and what msgpack's own packer
        took (numpy scalars, int, float and str subclasses such as IntEnum, numpy.float64 and
        str Enums, tuple subclasses such as namedtuples) its plain value; anything else is refused."""
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
            if isinstance(value, int) and type(value) is not int:  # IntEnum; a plain int here is past 64 bits
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

    def encode_body(self, seq: int, tseq: int, ts, data, t: float | None = None) -> tuple[bytes, list | None]:
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
        if len(body) + len(self._burst_head) > limits.max_body_bytes or len(frames) > limits.max_frames \
                or frames and sum(map(len, frames)) > limits.max_message_bytes - limits.max_body_bytes:
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


def event_frames(msg: Message) -> list:
    """The frames of `msg` as a message of its own: the frames it arrived in, or, for an
    event that came in a burst, the same fields framed again (tensors without a copy)."""
    if msg.raw is not None:
        return msg.raw
    return EventEncoder(msg.run, msg.pub, msg.rank).encode(msg.topic, msg.seq, msg.tseq,
                                                           msg.ts, msg.data, msg.t)


def _no_ext(code: int, payload: bytes) -> Any:
    if code == TENSOR_EXT:
        raise WireError("body refers to a tensor frame, but the message has none")
    raise WireError(f"unknown msgpack ext type {code}")


def _unpack(body: bytes | memoryview, limits: Limits, frames=None) -> Any:
    """msgpack-decode a body; every string, array and map is bounded by the body's own
    size (msgpack's default) and containers by `limits.max_container_len`."""
    if frames is None:  # the common case: no tensor frames, no closure to build
        try:
            return msgpack.unpackb(body, strict_map_key=True, ext_hook=_no_ext,
                                   max_array_len=limits.max_container_len,
                                   max_map_len=limits.max_container_len)
        except WireError:
            raise
        except Exception as exc:
            raise WireError(f"malformed msgpack body: {exc.__class__.__name__}: {exc}") from None
    used: set[int] = set()

    def ext_hook(code: int, payload: bytes) -> Any:
        if code != TENSOR_EXT:
            raise WireError(f"unknown msgpack ext type {code}")
        tensor, index = _tensor_from_ext(payload, frames, limits)
        used.add(index)
        return tensor

    try:
        value = msgpack.unpackb(
            body, strict_map_key=True, ext_hook=_no_ext if frames is None else ext_hook,
            max_array_len=limits.max_container_len, max_map_len=limits.max_container_len,
        )
    except WireError:
        raise
    except Exception as exc:  # msgpack raises several types; callers see one
        raise WireError(f"malformed msgpack body: {exc.__class__.__name__}: {exc}") from None
    if frames is not None and len(used) != len(frames) - 1:
        raise WireError(f"message has {len(frames) - 1} tensor frames, its body uses {len(used)}")
    return value


def _tensor_from_ext(payload: bytes, frames, limits: Limits) -> tuple[TensorFrame, int]:
    try:
        index, dtype, shape = msgpack.unpackb(payload, raw=False, max_array_len=64)
    except Exception:
        raise WireError("malformed tensor descriptor") from None
    if not isinstance(index, int) or not 1 <= index < len(frames):
        raise WireError(f"tensor refers to frame {index!r}, message has {len(frames)} frames")
    if dtype not in DTYPE_SIZES:
        raise WireError(f"tensor dtype {dtype!r} is not one of {sorted(DTYPE_SIZES)}")
    if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
        raise WireError(f"tensor shape {shape!r} is not a list of non-negative ints")
    data = frames[index]
    expected = math.prod(shape) * DTYPE_SIZES[dtype]
    if expected != len(data):
        raise WireError(f"tensor frame has {len(data)} bytes, {dtype}{shape} needs {expected}")
    return TensorFrame(dtype, tuple(shape), data), index


def _frame_bytes(frame) -> memoryview | bytes:
    return frame.buffer if hasattr(frame, "buffer") else frame


def _require(body: Any, schema: dict[str, type | tuple[type, ...]], what: str) -> dict:
    if not isinstance(body, dict):
        raise WireError(f"{what} body is {type(body).__name__}, expected a map")
    version = body.get("v")
    if version != VERSION:
        raise WireError(f"wire version {version!r} is not supported (this build speaks {VERSION})")
    for key, kind in schema.items():
        if not isinstance(body.get(key), kind) or isinstance(body.get(key), bool) and kind is int:
            raise WireError(f"{what} field {key!r} is {body.get(key)!r}, expected {_names(kind)}")
    return body


def _names(kind) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


_HEARTBEAT_SCHEMA = {
    "k": str, "run": str, "pub": str, "rank": int, "seq": int, "tseq": dict, "t": (float, int),
    "beat": int, "final": bool, "drops": int, "interval": (float, int),
}


def check_size(frames, limits: Limits = DEFAULT_LIMITS) -> None:
    """Refuse a message by its sizes alone, before any byte of it is decoded."""
    if not frames:
        raise WireError("empty message")
    if len(frames) > limits.max_frames + 1:
        raise WireError(f"message has {len(frames)} frames, the limit is {limits.max_frames + 1}")
    head = len(frames[0])
    if head > limits.max_body_bytes:
        raise WireError(f"message body is {head} bytes, the limit is {limits.max_body_bytes}")
    total = sum(len(f) for f in frames)
    if total > limits.max_message_bytes:
        raise WireError(f"message is {total} bytes, the limit is {limits.max_message_bytes}")


def _head_and_tensors(frames, limits: Limits) -> tuple[bytes, list | None]:
    """Frame 0 as bytes and, when tensor frames follow, all frames as buffers; refused
    by their sizes alone before any byte is decoded."""
    if len(frames) == 1:  # the common case: no tensors, checked without building lists
        head = frames[0] if type(frames[0]) is bytes else bytes(_frame_bytes(frames[0]))
        if len(head) > limits.max_body_bytes:
            raise WireError(f"message body is {len(head)} bytes, the limit is {limits.max_body_bytes}")
        return head, None
    frames = [_frame_bytes(f) for f in frames]
    check_size(frames, limits)
    return (frames[0] if type(frames[0]) is bytes else bytes(frames[0])), frames


def decode_event(frames, limits: Limits = DEFAULT_LIMITS) -> Message:
    """Decode an event or heartbeat from its frames (bytes, memoryviews or zmq Frames)."""
    head, tensor_frames = _head_and_tensors(frames, limits)
    cut = head.find(b"\0")
    if cut <= 0:
        raise WireError("frame 0 has no topic prefix (expected b'<topic>\\0' then the body)")
    try:
        topic = head[:cut].decode()
    except UnicodeDecodeError:
        raise WireError("topic is not UTF-8") from None
    body = _unpack(head[cut + 1 :], limits, tensor_frames)
    if topic == HEARTBEAT_TOPIC:
        body = _require(body, _HEARTBEAT_SCHEMA, "heartbeat")
        return Message(topic, "hb", body["run"], body["pub"], body["rank"], body["seq"], 0,
                       float(body["t"]), (0, 0, 0, 0, 0), body)
    if type(body) is not list or len(body) != 10:
        if isinstance(body, dict) and body.get("v") != VERSION or isinstance(body, list) and body \
                and body[0] != VERSION:
            version = body.get("v") if isinstance(body, dict) else body[0]
            raise WireError(f"wire version {version!r} is not supported (this build speaks {VERSION})")
        raise WireError(f"event body is {_shape(body)}, expected an array of 10 fields")
    v, k, run, pub, rank, seq, tseq, t, ts, d = body
    if v != VERSION:
        raise WireError(f"wire version {v!r} is not supported (this build speaks {VERSION})")
    if not (type(k) is str and type(run) is str and type(pub) is str and type(rank) is int
            and type(seq) is int and type(tseq) is int and type(t) is float and type(d) is dict
            and type(ts) is list and len(ts) == 5 and type(ts[0]) is int and type(ts[1]) is int
            and type(ts[2]) is int and type(ts[3]) is int and type(ts[4]) is int):
        _explain_event(body)
    return Message(topic, k, run, pub, rank, seq, tseq, t, tuple(ts), d)


_EVENT_FIELDS = (("v", int), ("kind", str), ("run", str), ("pub", str), ("rank", int),
                 ("seq", int), ("tseq", int), ("t", float), ("ts", list), ("d", dict))


def _explain_event(body: list) -> None:
    """Raise a WireError naming the first event field of the wrong type."""
    for (name, kind), value in zip(_EVENT_FIELDS, body, strict=True):
        if type(value) is not kind:
            raise WireError(f"event field {name!r} is {value!r}, expected {kind.__name__}")
    raise WireError(f"event field 'ts' is {body[8]!r}, expected 5 ints")


def _shape(value: Any) -> str:
    if isinstance(value, (list, dict)):
        return f"a {type(value).__name__} of {len(value)}"
    return type(value).__name__


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
            raise WireError(f"wire version {version!r} is not supported (this build speaks {VERSION})")
        raise WireError(f"burst body is {_shape(body)}, expected an array of 8 fields")
    _, kind, run, pub, rank, seq, tseq, events = body
    if not (kind == "bu" and type(run) is str and type(pub) is str and type(rank) is int
            and type(seq) is int and type(tseq) is dict and type(events) is list):
        raise WireError("burst header must be [2, 'bu', run: str, pub: str, rank: int, seq: int, "
                        "tseq: map, events: list]")
    for topic, n in tseq.items():  # every topic checked once here, not at each of its events
        if type(topic) is not str or not topic or topic[0] == "_" or "\0" in topic:
            raise WireError(f"burst topic {topic!r} is not a string, or empty, reserved (_...) or has NUL")
        if type(n) is not int:
            raise WireError(f"burst tseq of {topic!r} is {n!r}, expected an int")
    nxt = dict(tseq)
    out = []
    append = out.append
    ts = None
    for ev in events:
        if type(ev) is not list or not 3 <= len(ev) <= 4:
            raise WireError(f"burst event is {_shape(ev)}, expected [topic, t, d] or [topic, t, d, ts]")
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
    return out


def encode_heartbeat(run: str, pub: str, rank: int, seq: int, tseq: dict[str, int],
                     drops: int, interval: float, beat: int, final: bool = False) -> bytes:
    """Heartbeat: ``b"_hb\\0" + {v, k: "hb", run, pub, rank, seq, tseq: {topic: n}, t,
    drops, interval, beat, final}``: the latest sequence numbers make tail loss visible,
    `beat` counts heartbeats, and `final` says the publisher is closing."""
    body = {"v": VERSION, "k": "hb", "run": run, "pub": pub, "rank": rank, "seq": seq,
            "tseq": tseq, "t": time.time(), "drops": drops, "interval": interval, "beat": beat,
            "final": final}
    return topic_prefix(HEARTBEAT_TOPIC) + msgpack.packb(body)


# ------------------------------------------------- request / reply (state, control)

#: Request kinds and the fields each must carry.
REQUEST_SCHEMAS: dict[str, dict[str, Any]] = {
    "state_req": {"k": str},
    "info_req": {"k": str},
    "ctl": {"k": str, "client": str, "req": int, "op": str, "args": dict},
}
REPLY_SCHEMAS: dict[str, dict[str, Any]] = {
    "state": {"k": str, "run": str, "pub": str, "seq": int, "tseq": dict, "beat": int,
              "config": dict, "entries": list},
    "info": {"k": str, "run": dict},
    "ack": {"k": str, "client": str, "req": int, "op": str, "ok": bool, "result": dict},
    "error": {"k": str, "error": str},
}


def encode_request(kind: str, **fields: Any) -> bytes:
    """A request body: ``{v, k: kind, ...fields}``.

    - ``state_req {topics: [str] | nil}`` asks for the late-join state;
    - ``info_req {}`` asks for the run's run.json content;
    - ``ctl {client, req, op: "halt"|"checkpoint", args, t}`` is a control request.
    """
    if kind not in REQUEST_SCHEMAS:
        raise WireError(f"unknown request kind {kind!r}")
    return msgpack.packb({"v": VERSION, "k": kind, **fields}, default=_no_pickle)


def encode_reply(kind: str, **fields: Any) -> bytes:
    """A reply body: ``state``, ``info``, ``ack {client, req, op, ok, result, error}`` or
    ``error {error}`` (the answer to a request the server could not read)."""
    if kind not in REPLY_SCHEMAS:
        raise WireError(f"unknown reply kind {kind!r}")
    return msgpack.packb({"v": VERSION, "k": kind, **fields}, default=_no_pickle)


def _no_pickle(value: Any) -> Any:
    if hasattr(value, "item") and hasattr(value, "dtype"):
        return value.item()
    raise WireError(f"cannot encode {type(value).__name__} on the wire (not pickled, by design)")


def _decode_body(frame, schemas: dict, limits: Limits, what: str) -> dict:
    data = _frame_bytes(frame)
    if len(data) > limits.max_body_bytes:
        raise WireError(f"{what} is {len(data)} bytes, the limit is {limits.max_body_bytes}")
    body = _unpack(data, limits)
    kind = body.get("k") if isinstance(body, dict) else None
    if not isinstance(kind, str) or kind not in schemas:  # an unhashable kind must not raise TypeError
        raise WireError(f"{what} kind {kind!r} is not one of {sorted(schemas)}")
    return _require(body, schemas[kind], what)


def decode_request(frame, limits: Limits = DEFAULT_LIMITS) -> dict:
    return _decode_body(frame, REQUEST_SCHEMAS, limits, "request")


def decode_reply(frame, limits: Limits = DEFAULT_LIMITS) -> dict:
    return _decode_body(frame, REPLY_SCHEMAS, limits, "reply")
