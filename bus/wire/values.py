"""What any offloop message may hold, and the bounds on reading it: the version, the
reserved topics, tensors (msgpack ext type 1 naming a raw frame), `Limits`, `Message`.
Promise: untrusted bytes decode within `Limits` or raise `WireError`, never anything else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import msgpack
import ormsgpack

from offloop.bus.errors import WireError

VERSION = 2
HEARTBEAT_TOPIC = "_hb"
BURST_TOPIC = "_burst"
BURST_PREFIX = b"_burst\0"
#: how a subscriber of named topics takes them in bursts (docs/protocol.md): it subscribes
#: to BURSTS_OF_TOPICS, with which every burst's frame 0 starts (the version 2 header, an
#: array of 8), and to `want_prefix(topic)` for each topic, a prefix no message starts with
#: (topics starting with "_" are reserved) that tells the publisher to hold the topic for
#: its bursts without sending it as messages of their own
BURSTS_OF_TOPICS = BURST_PREFIX + b"\x98"
WANT_PREFIX = b"_want\0"
#: the longest topic, in UTF-8 bytes: a subscription names at most one topic, and each
#: byte of a prefix costs memory in every socket's subscription trie
MAX_TOPIC_BYTES = 255
#: the longest frame a peer may send into an events socket (its ZMQ_MAXMSGSIZE; libzmq
#: cuts the connection of a longer one): a subscription is a prefix of at most one topic
#: and its NUL after b"\x09SUBSCRIBE", but the limit applies to the handshake too (CURVE's
#: INITIATE carries a routing id of up to 255 bytes) and to CURVE's encrypted frames
MAX_SUBSCRIPTION_BYTES = 1024
TENSOR_EXT = 1

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
    #: a request (state, info, control) is small: at most this many bytes, so at most as
    #: many objects, is all its decoding can cost (well under a millisecond)
    max_request_bytes: int = 16 << 10
    #: the longest list or map a request may hold (a state_req's topics)
    max_request_items: int = 1024

DEFAULT_LIMITS = Limits()


def topic_prefix(topic: str) -> bytes:
    """The bytes a SUB socket subscribes to for exactly this topic."""
    if "\0" in topic or not topic:
        raise WireError(f"topic {topic!r} is empty or contains NUL")
    encoded = topic.encode()
    if len(encoded) > MAX_TOPIC_BYTES:
        raise WireError(f"topic {topic[:40]!r}... is {len(encoded)} bytes long, over "
                        f"{MAX_TOPIC_BYTES}")
    return encoded + b"\0"


def want_prefix(topic: str) -> bytes:
    """The bytes a SUB socket subscribes to for this topic's events in bursts (beside
    BURSTS_OF_TOPICS)."""
    return WANT_PREFIX + topic_prefix(topic)


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


# ---------------------------------------------------------------------- decoding


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
    refs: list[int] = []  # the frame each tensor descriptor names, in order

    def ext_hook(code: int, payload: bytes) -> Any:
        if code != TENSOR_EXT:
            raise WireError(f"unknown msgpack ext type {code}")
        tensor, index = _tensor_from_ext(payload, frames, limits)
        refs.append(index)
        return tensor

    try:
        value = msgpack.unpackb(
            body, strict_map_key=True, ext_hook=ext_hook,
            max_array_len=limits.max_container_len, max_map_len=limits.max_container_len,
        )
    except WireError:
        raise
    except Exception as exc:  # msgpack raises several types; callers see one
        raise WireError(f"malformed msgpack body: {exc.__class__.__name__}: {exc}") from None
    if len(refs) != len(frames) - 1 or len(set(refs)) != len(refs):
        _explain_refs(refs, len(frames) - 1)
    return value


def _explain_refs(refs: list[int], count: int) -> None:
    """Raise a WireError naming a tensor frame not referred to by exactly one tensor."""
    for index in range(1, count + 1):
        n = refs.count(index)
        if n != 1:
            raise WireError(f"tensor frame {index} is referred to by {n} tensor descriptors; "
                            f"each of the message's {count} tensor frames must be referred to "
                            "by exactly one")
    # not reached
    raise WireError(f"message has {count} tensor frames, its body refers to {len(refs)}")


def _tensor_from_ext(payload: bytes, frames, limits: Limits) -> tuple[TensorFrame, int]:
    try:
        index, dtype, shape = msgpack.unpackb(payload, raw=False, max_array_len=64)
    except Exception:
        raise WireError("malformed tensor descriptor") from None
    # type() is int, not isinstance: msgpack's true and false are not ints
    if type(index) is not int or not 1 <= index < len(frames):
        raise WireError(f"tensor frame_index {index!r} is not an int naming one of the message's "
                        f"{len(frames) - 1} tensor frames (1..{len(frames) - 1})")
    if type(dtype) is not str or dtype not in DTYPE_SIZES:
        raise WireError(f"tensor dtype {dtype!r} is not one of {sorted(DTYPE_SIZES)}")
    if type(shape) is not list or not all(type(n) is int and n >= 0 for n in shape):
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
        value = body.get(key)
        # msgpack's true and false are not numbers: bool is an int only to Python
        if not isinstance(value, kind) or type(value) is bool and kind is not bool:
            raise WireError(f"{what} field {key!r} is "
                            f"{'missing' if key not in body else repr(value)}, "
                            f"expected {_names(kind)}")
    return body


# What `check_values` refuses and msgpack's options let through: a bin map key
# (strict_map_key admits str and bytes) and msgpack's timestamp (ext type -1, which msgpack
# decodes itself rather than handing it to ext_hook). ormsgpack's packer refuses both (a
# key that is not a str, a type it does not know) in one call in Rust: a screen that costs
# a few nanoseconds per value, and only what it refuses is looked at in Python.
_screen = ormsgpack.packb
_SCREEN_OPTIONS = ormsgpack.OPT_PASSTHROUGH_DATACLASS | ormsgpack.OPT_PASSTHROUGH_BIG_INT


def _screen_default(value: Any) -> Any:
    if type(value) is TensorFrame:  # a decoded tensor: what it holds was checked
        return None
    raise TypeError(type(value).__name__)


def check_values(value: Any) -> None:
    """Refuse (WireError) a map key that is not a str, or a msgpack timestamp, anywhere in
    `value` (an event's d, a list of a burst's d, a heartbeat, a request): what d may hold is
    "maps with str keys" and tensors, the only ext type carried (docs/protocol.md)."""
    try:
        _screen(value, default=_screen_default, option=_SCREEN_OPTIONS)
    except Exception:  # refused by the screen (or nested past its 255 levels): look closely
        _check_values_slowly(value)


def _check_values_slowly(value: Any) -> None:
    """check_values in Python, level by level (msgpack nests up to its own depth limit)."""
    maps: list[dict] = []
    lists: list[list] = [[value]]
    while maps or lists:
        values: list = []
        for m in maps:
            for key in m:
                if type(key) is not str:
                    raise WireError(f"map key {key!r} is {type(key).__name__}; "
                                    "map keys must be str")
            values.extend(m.values())
        for items in lists:
            values.extend(items)
        if any(type(v) is msgpack.Timestamp for v in values):
            raise WireError("a msgpack timestamp (ext type -1) cannot travel: the only ext type "
                            "carried is 1, a tensor")
        maps = [v for v in values if type(v) is dict]
        lists = [v for v in values if type(v) is list]


def _names(kind) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


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
            raise WireError(f"message body is {len(head)} bytes, "
                            f"the limit is {limits.max_body_bytes}")
        return head, None
    frames = [_frame_bytes(f) for f in frames]
    check_size(frames, limits)
    return (frames[0] if type(frames[0]) is bytes else bytes(frames[0])), frames


def _shape(value: Any) -> str:
    if isinstance(value, (list, dict)):
        return f"a {type(value).__name__} of {len(value)}"
    return type(value).__name__


