"""An oracle for offloop's wire format, version 2, written from docs/protocol.md (and the
layouts repeated in the docstrings of bus/wire/*.py and bus/control.py), not from the
decoders: it imports nothing from offloop. Given the frames of one message, it says what
the docs say they are: valid, with what a reader must decode from them, or malformed,
with the documented rule they break.

msgpack is parsed with `msgpack.unpackb` under the oracle's own settings: every str must be
UTF-8, but any map key type, every ext type and containers of any length (up to the body's
own size) are let through, so that the documented rules on them (str keys, ext type 1 only,
100 000 entries at most) are checked here rather than by the library's options.

Each rule has a name (`Malformed.rule`). A caller that knows the product breaks a rule may
`waive` it by name to learn what the message would be without that rule; the rules are
cut fine enough for that (bytes keys apart from other non-str keys, a heartbeat's kind
apart from its type, ...). The other way round, a check the product makes that the docs
do not (PRODUCT_ONLY) is applied only when a caller names it in `impose`. Where the docs
leave a point open, the choice made is said where it is made.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import msgpack

VERSION = 2

# "Limits on untrusted bytes", the documented defaults
MAX_BODY = 4 * 1024 * 1024  # frame 0 / request body
MAX_TENSOR_FRAMES = 64  # tensor frames per message
MAX_MESSAGE = 256 * 1024 * 1024  # whole message
MAX_CONTAINER = 100_000  # msgpack array/map length
MAX_REQUEST = 16 * 1024  # a request body (state, info, control)
MAX_REQUEST_ITEMS = 1024  # a request's longest array or map

# the dtypes the docs list, with the size of one element of each
DTYPES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
          "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16}
TENSOR_EXT = 1
HEARTBEAT, BURST = "_hb", "_burst"
REQUEST_KINDS = ("ctl", "state_req", "info_req")
CONTROL_OPS = ("halt", "checkpoint")
#: a checkpoint file name the control server takes; a checkpoint request naming any other
#: str is refused at once (ok: false, like an unknown op), not counted malformed
PLAIN_FILE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}\Z")
#: checks the product made that docs/protocol.md does not, applied only when imposed:
#: "info-topics": an info_req's `topics`, a field it does not have, must be [str] or nil
#: (the docs: "Adding a field to a map is not a version change"; the product no longer does)
PRODUCT_ONLY = frozenset({"info-topics"})


class Malformed(Exception):
    def __init__(self, rule: str, why: str) -> None:
        super().__init__(f"[{rule}] {why}")
        self.rule, self.why = rule, why


@dataclass(frozen=True)
class Tensor:
    """A tensor as the docs say a reader gets it: dtype, shape and the frame's bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes


@dataclass(frozen=True)
class Event:
    """One event as a reader decodes it (a heartbeat too: kind "hb", its whole map in `d`,
    `tseq` and `ts` None, since a heartbeat has neither)."""

    topic: str
    kind: str
    run: str
    pub: str
    rank: int
    seq: int
    tseq: int | None
    t: float
    ts: tuple | None
    d: dict


@dataclass(frozen=True)
class Verdict:
    valid: bool
    rule: str | None = None  # the first documented rule broken (None when valid)
    why: str = ""
    kind: str | None = None  # "ev", "hb", "bu"; a request's or reply's "k"
    events: tuple[Event, ...] = ()  # what a subscriber must decode (one for "ev" and "hb")
    body: Any = None  # a request's or reply's map, tensors as Tensor
    entries: tuple[Verdict, ...] = ()  # a state reply: the verdict on each entry
    envelope: tuple[bytes, ...] = ()  # a relayed request's (client, b""): its reply comes back behind it

    def __bool__(self) -> bool:  # `if verdict:` reads as "if valid"
        return self.valid


class _Check:
    """The rules in force: `need(ok, rule, why)` raises Malformed unless `rule` is waived."""

    def __init__(self, waive=(), impose=()) -> None:
        self.waive = frozenset(waive) - PRODUCT_ONLY  # what is imposed is not waived
        self.impose = frozenset(impose) & PRODUCT_ONLY

    def need(self, ok: bool, rule: str, why: str) -> None:
        if not ok and rule not in self.waive:
            raise Malformed(rule, why)


def is_int(value: Any) -> bool:
    """A msgpack int: Python's bool is an int, msgpack's true and false are not."""
    return type(value) is int


def is_number(value: Any) -> bool:
    return type(value) in (int, float)


# ----------------------------------------------------------------------------- msgpack


def _parse(data: bytes, ck: _Check, what: str) -> Any:
    """Exactly one msgpack value (trailing bytes are an error), every str UTF-8."""
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # bad msgpack, trailing bytes, bad UTF-8, an unhashable key
        raise Malformed("msgpack", f"{what} is not one msgpack value: {type(exc).__name__}") from None


class _Tensors:
    """The tensor frames of one message (frame 1...) and how often each is referred to."""

    def __init__(self, frames: list[bytes]) -> None:
        self.frames = frames
        self.used = [0] * len(frames)


def _walk(value: Any, ck: _Check, tensors: _Tensors | None) -> Any:
    """`value` with every tensor descriptor replaced by a Tensor, checking the rules every
    msgpack value here obeys: container lengths, str map keys, ext type 1 only (and only
    where tensors may be, `tensors` not None). Iterative: msgpack nests up to 1024 deep."""
    holder = [value]
    stack: list = [holder]
    while stack:
        container = stack.pop()
        if isinstance(container, dict):
            ck.need(len(container) <= MAX_CONTAINER, "container-len",
                    f"a map of {len(container)} entries")
            for key in container:
                if type(key) is bytes:
                    ck.need(False, "bytes-keys", f"map key {key!r} is bin, not str")
                else:
                    ck.need(type(key) is str, "str-keys", f"map key {key!r} is not a str")
            items = list(container.items())
        else:
            ck.need(len(container) <= MAX_CONTAINER, "container-len",
                    f"an array of {len(container)} entries")
            items = list(enumerate(container))
        for key, item in items:
            if isinstance(item, (dict, list)):
                stack.append(item)
            elif isinstance(item, msgpack.Timestamp):  # ext type -1, which msgpack reads itself
                ck.need(False, "ext-timestamp", "msgpack timestamp (ext type -1): not a tensor")
            elif isinstance(item, msgpack.ExtType):
                container[key] = _tensor(item, ck, tensors)
    return holder[0]


def _tensor(ext: msgpack.ExtType, ck: _Check, tensors: _Tensors | None) -> Any:
    ck.need(ext.code == TENSOR_EXT, "ext-type", f"msgpack ext type {ext.code}, only 1 (a tensor)")
    ck.need(tensors is not None, "tensor", "a tensor where no tensor frame can be")
    if ext.code != TENSOR_EXT or tensors is None:
        return ext  # waived
    desc = _walk(_parse(ext.data, ck, "a tensor descriptor"), ck, None)
    ck.need(type(desc) is list and len(desc) == 3, "tensor",
            f"descriptor {desc!r} is not [frame_index, dtype, shape]")
    if type(desc) is not list or len(desc) != 3:
        return ext  # waived
    index, dtype, shape = desc
    if type(index) is bool or any(type(n) is bool for n in (shape if type(shape) is list else [])):
        ck.need(False, "tensor-bool", f"descriptor {desc!r} has true/false where ints go")
        index = int(index) if type(index) is bool else index
        shape = [int(n) if type(n) is bool else n for n in shape] if type(shape) is list else shape
    ok_index = is_int(index) and 1 <= index < len(tensors.frames)
    ok_dtype = type(dtype) is str and dtype in DTYPES
    ok_shape = type(shape) is list and all(is_int(n) and n >= 0 for n in shape)
    ck.need(ok_index, "tensor",
            f"frame_index {index!r}, the message has {len(tensors.frames) - 1} tensor frames")
    ck.need(ok_dtype, "tensor", f"dtype {dtype!r}")
    ck.need(ok_shape, "tensor", f"shape {shape!r} is not an array of non-negative ints")
    if not (ok_index and ok_dtype and ok_shape):
        return ext  # waived
    frame = tensors.frames[index]
    need = math.prod(shape) * DTYPES[dtype]
    ck.need(len(frame) == need, "tensor", f"{dtype}{shape} needs {need} bytes, frame has {len(frame)}")
    tensors.used[index] += 1
    return Tensor(dtype, tuple(shape), bytes(frame))


def _all_frames_used_once(tensors: _Tensors, ck: _Check) -> None:
    for i in range(1, len(tensors.frames)):
        if tensors.used[i] == 0:
            ck.need(False, "tensor", f"tensor frame {i} is referred to by no tensor")
        else:
            ck.need(tensors.used[i] == 1, "tensor-frames-once",
                    f"tensor frame {i} is referred to by {tensors.used[i]} tensors")


def _sizes(frames: list[bytes], ck: _Check) -> None:
    ck.need(len(frames) >= 1, "limits", "no frames")
    ck.need(len(frames) - 1 <= MAX_TENSOR_FRAMES, "limits", f"{len(frames) - 1} tensor frames")
    ck.need(len(frames[0]) <= MAX_BODY, "limits", f"frame 0 is {len(frames[0])} bytes")
    ck.need(sum(map(len, frames)) <= MAX_MESSAGE, "limits", "the message is over 256 MiB")


def _version(v: Any, ck: _Check) -> None:
    ck.need(is_int(v) and v == VERSION, "version", f"version {v!r}, not {VERSION}")


def _ts(ts: Any, ck: _Check, rule: str) -> tuple:
    ck.need(type(ts) is list and len(ts) == 5 and all(is_int(n) for n in ts), rule,
            f"ts {ts!r} is not [epoch, batch, batch_in_epoch, sample, token] (5 ints)")
    return tuple(ts)


def valid_topic(topic: Any) -> bool:
    """A topic a publisher may publish: a non-empty str without NUL, not reserved (`_...`)."""
    return type(topic) is str and bool(topic) and "\0" not in topic and not topic.startswith("_")


# ---------------------------------------------------------------- events (PUB/SUB)


def message(frames, waive=(), impose=()) -> Verdict:
    """What a subscriber receiving `frames` (an event, heartbeat or burst) must do."""
    ck = _Check(waive, impose)
    frames = [bytes(f) for f in frames]
    try:
        _sizes(frames, ck)
        head = frames[0]
        cut = head.find(b"\0")
        ck.need(cut > 0, "topic", "frame 0 does not start with a topic then NUL")
        try:
            topic = head[:cut].decode()
        except UnicodeDecodeError:
            raise Malformed("topic", "the topic is not UTF-8") from None
        body, tensors = head[cut + 1:], _Tensors(frames)
        if topic == HEARTBEAT:
            return _heartbeat(body, frames, ck)
        if topic == BURST:
            return _burst(body, tensors, ck)
        # the docs reserve every topic starting with "_"; only _hb and _burst carry messages
        ck.need(not topic.startswith("_"), "reserved-topic", f"topic {topic!r} is reserved")
        return _event(topic, body, tensors, ck)
    except Malformed as exc:
        return Verdict(False, exc.rule, exc.why)


def _array_body(body: bytes, count: int, what: str, ck: _Check, tensors: _Tensors) -> list:
    """A message body that must be an array of `count` fields (an event's or a burst's)."""
    value = _walk(_parse(body, ck, f"the {what} body"), ck, tensors)
    _all_frames_used_once(tensors, ck)
    if type(value) is not list or len(value) != count:
        if type(value) is list and value:
            _version(value[0], ck)
        raise Malformed(f"{what}-shape", f"the {what} body is not an array of {count} fields")
    return value


def _event(topic: str, body: bytes, tensors: _Tensors, ck: _Check) -> Verdict:
    v, kind, run, pub, rank, seq, tseq, t, ts, d = _array_body(body, 10, "event", ck, tensors)
    _version(v, ck)
    ck.need(type(kind) is str, "event-shape", f"kind {kind!r} is not a str")
    ck.need(kind == "ev", "event-kind", f"kind {kind!r} is not 'ev'")
    for name, field, ok in (("run", run, type(run) is str), ("pub", pub, type(pub) is str),
                            ("rank", rank, is_int(rank)), ("seq", seq, is_int(seq)),
                            ("tseq", tseq, is_int(tseq)), ("t", t, type(t) is float),
                            ("d", d, type(d) is dict)):
        ck.need(ok, "event-shape", f"field {name} is {field!r}")
    ts = _ts(ts, ck, "event-shape")
    return Verdict(True, kind="ev", events=(Event(topic, kind, run, pub, rank, seq, tseq, t, ts, d),))


def _heartbeat(body: bytes, frames: list[bytes], ck: _Check) -> Verdict:
    # The docs give a heartbeat frame 0 alone: a tensor in it has no frame to refer to.
    ck.need(len(frames) == 1, "hb-one-frame", f"a heartbeat of {len(frames)} frames")
    tensors = _Tensors(frames)
    value = _walk(_parse(body, ck, "the heartbeat body"), ck, tensors)
    _all_frames_used_once(tensors, ck)
    ck.need(type(value) is dict, "hb-shape", "the heartbeat body is not a map")
    _version(value.get("v"), ck)
    # Field types: run, pub, rank, seq and t as in an event; counters (drops, beat) ints;
    # `final: bool`. The docs give no type to `t` and `interval` here: any number (not
    # true/false, which msgpack does not take for numbers) is accepted.
    k = value.get("k")
    ck.need(type(k) is str, "hb-shape", f"k is {k!r}")
    ck.need(k == "hb", "hb-kind", f"k is {k!r}, not 'hb'")
    for name, ok in (("run", type(value.get("run")) is str), ("pub", type(value.get("pub")) is str),
                     ("rank", is_int(value.get("rank"))), ("seq", is_int(value.get("seq"))),
                     ("drops", is_int(value.get("drops"))), ("beat", is_int(value.get("beat"))),
                     ("final", type(value.get("final")) is bool),
                     ("tseq", type(value.get("tseq")) is dict)):
        ck.need(ok, "hb-shape", f"field {name} is {value.get(name, 'missing')!r}")
    for name in ("t", "interval"):
        field = value.get(name)
        if type(field) is bool:
            ck.need(False, "hb-number-bool", f"field {name} is {field!r}, not a number")
        else:
            ck.need(is_number(field), "hb-shape", f"field {name} is {value.get(name, 'missing')!r}")
    for topic, n in value["tseq"].items():  # {topic: latest tseq}
        ck.need(type(topic) is str and is_int(n), "hb-tseq", f"tseq entry {topic!r}: {n!r}")
    if "refused" in value:  # optional: {kind of refusal: count}
        refused = value["refused"]
        ck.need(type(refused) is dict, "hb-refused", f"refused is {refused!r}, not a map")
        for what, n in refused.items():
            ck.need(type(what) is str and is_int(n), "hb-refused", f"refused entry {what!r}: {n!r}")
    event = Event(HEARTBEAT, "hb", value["run"], value["pub"], value["rank"], value["seq"], None,
                  float(value["t"]), None, value)
    return Verdict(True, kind="hb", events=(event,))


def _burst(body: bytes, tensors: _Tensors, ck: _Check) -> Verdict:
    v, kind, run, pub, rank, seq, tseq, events = _array_body(body, 8, "burst", ck, tensors)
    _version(v, ck)
    ck.need(kind == "bu", "burst-shape", f"kind {kind!r} is not 'bu'")
    for name, field, ok in (("run", run, type(run) is str), ("pub", pub, type(pub) is str),
                            ("rank", rank, is_int(rank)), ("seq", seq, is_int(seq)),
                            ("tseq", tseq, type(tseq) is dict),
                            ("events", events, type(events) is list)):
        ck.need(ok, "burst-shape", f"field {name} is {field!r}")
    for topic, n in tseq.items():  # "every topic in tseq must be a valid topic"
        ck.need(valid_topic(topic), "burst-topic", f"tseq topic {topic!r} is not a valid topic")
        ck.need(is_int(n), "burst-shape", f"tseq of {topic!r} is {n!r}")
    nxt = dict(tseq)
    out, ts = [], None
    for i, entry in enumerate(events):
        ck.need(type(entry) is list and len(entry) in (3, 4), "burst-event",
                f"event {i} is not [topic, t, d] or [topic, t, d, ts]")
        topic, t, d = entry[:3]
        if len(entry) == 4:
            ts = _ts(entry[3], ck, "burst-event")
        ck.need(ts is not None, "burst-event", "the first event carries no ts")
        ck.need(type(topic) is str and topic in nxt, "burst-event",
                f"event {i}'s topic {topic!r} is not in the burst's tseq")
        ck.need(type(t) is float, "burst-event", f"event {i}'s t is {t!r}")
        ck.need(d is None or type(d) is dict, "burst-event", f"event {i}'s d is {d!r}")
        out.append(Event(topic, "ev", run, pub, rank, seq + i, nxt[topic], t, ts,
                         {} if d is None else d))
        nxt[topic] += 1
    return Verdict(True, kind="bu", events=tuple(out))


# ------------------------------------------------------------------------- requests


def _longest(value) -> int:
    """The length of the longest array or map in `value`."""
    if type(value) is dict:
        return max([len(value), *(_longest(v) for v in value.values())])
    if type(value) is list:
        return max([len(value), *(_longest(v) for v in value)])
    return 0


def _request(frames, ck: _Check) -> dict:
    frames = [bytes(f) for f in frames]
    ck.need(len(frames) == 1, "request-one-frame", f"a request of {len(frames)} frames")
    ck.need(len(frames[0]) <= MAX_REQUEST, "request-size", f"a request of {len(frames[0])} bytes")
    body = _walk(_parse(frames[0], ck, "the request"), ck, None)
    ck.need(_longest(body) <= MAX_REQUEST_ITEMS, "request-items",
            f"a request holding {_longest(body)} items in one array or map")
    ck.need(type(body) is dict, "request-shape", "the request is not a map")
    _version(body.get("v"), ck)
    k = body.get("k")
    ck.need(type(k) is str and k in REQUEST_KINDS, "request-kind", f"request kind {k!r}")
    if k == "state_req":  # {v, k, topics: [str] | nil}
        ck.need("topics" in body, "state-topics-present", "a state_req without topics")
        topics = body.get("topics")
        ck.need(topics is None or type(topics) is list and all(type(t) is str for t in topics),
                "state-topics", f"topics {topics!r} is not [str] or nil")
    elif k == "info_req" and "info-topics" in ck.impose:
        topics = body.get("topics")
        ck.need(topics is None or type(topics) is list and all(type(t) is str for t in topics),
                "info-topics", f"(imposed) topics {topics!r} is not [str] or nil")
    elif k == "ctl":  # {v, k, client: str, req: int, op, args: map, t: float, wait: float > 0 (optional)}
        for name, ok in (("client", type(body.get("client")) is str),
                         ("req", is_int(body.get("req"))), ("op", type(body.get("op")) is str),
                         ("args", type(body.get("args")) is dict)):
            ck.need(ok, "ctl-shape", f"field {name} is {body.get(name, 'missing')!r}")
        ck.need(type(body.get("t")) is float, "ctl-t", f"t is {body.get('t', 'missing')!r}")
        wait = body.get("wait")  # optional: seconds the client waits for its answer
        ck.need(wait is None or type(wait) is float and wait > 0, "ctl-wait", f"wait is {wait!r}")
        args = body["args"]
        if body["op"] == "halt":  # {reason: str}
            ck.need(type(args.get("reason")) is str, "ctl-args", f"halt args {args!r}")
        elif body["op"] == "checkpoint":  # {tag: str, filename: str (optional)}
            ck.need(type(args.get("tag")) is str, "ctl-args", f"checkpoint args {args!r}")
            name = args.get("filename")
            # a str that is not a plain file name (PLAIN_FILE_NAME) is a readable request,
            # refused at once with ok: false like an unknown op: not a malformed one
            ck.need(name is None or type(name) is str, "ctl-args", f"checkpoint filename {name!r}")
        # any other op is readable and refused at once (ok: false); its args are not specified
    return body


def request(frames, waive=(), impose=()) -> Verdict:
    """A request as any DEALER/ROUTER server reads it (kind `body["k"]`): one frame, or,
    relayed (protocol.md, "Through a relay"), [client identity of 1-255 bytes, b"", body]."""
    ck = _Check(waive, impose)
    frames = [bytes(f) for f in frames]
    envelope: tuple[bytes, ...] = ()
    if len(frames) == 3 and frames[1] == b"" and 0 < len(frames[0]) <= 255:
        envelope, frames = (frames[0], b""), frames[2:]
    try:
        body = _request(frames, ck)
    except Malformed as exc:
        return Verdict(False, exc.rule, exc.why, envelope=envelope)
    return Verdict(True, kind=body["k"], body=body, envelope=envelope)


def control(frames, waive=(), impose=()) -> Verdict:
    """A request at the control socket, which serves `ctl` requests only."""
    verdict = request(frames, waive, impose)
    if verdict and verdict.kind != "ctl" and "control-kind" not in frozenset(waive):
        return Verdict(False, "control-kind", f"a {verdict.kind!r} request at the control socket")
    return verdict


def state_socket(frames, waive=(), impose=()) -> Verdict:
    """A request at a publisher's state socket, which serves state_req and info_req."""
    verdict = request(frames, waive, impose)
    if verdict and verdict.kind == "ctl" and "state-kind" not in frozenset(waive):
        return Verdict(False, "state-kind", "a control request at the state socket")
    return verdict


# -------------------------------------------------------------------------- replies


def reply(frames, waive=(), impose=()) -> Verdict:
    """A reply (error, ack, taken, info or state with its entries) as the docs lay it out."""
    ck = _Check(waive, impose)
    frames = [bytes(f) for f in frames]
    try:
        body = _walk(_parse(frames[0], ck, "the reply"), ck, None)
        ck.need(type(body) is dict, "reply-shape", "the reply is not a map")
        _version(body.get("v"), ck)
        k = body.get("k")
        fields: dict[str, Any] = {
            "error": {"error": str},
            "ack": {"client": str, "req": int, "op": str, "ok": bool, "result": dict},
            "taken": {"client": str, "req": int, "op": str, "result": dict},
            "info": {"run": dict},
            "state": {"run": str, "pub": str, "rank": int, "seq": int, "tseq": dict, "beat": int,
                      "config": dict, "entries": list},
        }.get(k) if type(k) is str else None
        ck.need(fields is not None, "reply-kind", f"reply kind {k!r}")
        for name, kind in fields.items():
            ck.need(type(body.get(name)) is kind, "reply-shape",
                    f"{k} field {name} is {body.get(name, 'missing')!r}")
        entries: list[Verdict] = []
        if k == "ack":
            ck.need(body.get("error") is None or type(body.get("error")) is str, "reply-shape",
                    f"ack error {body.get('error', 'missing')!r}")
            ck.need(body["ok"] or type(body.get("error")) is str, "reply-shape",
                    "a refusal names no error")
        elif k != "state":
            ck.need(len(frames) == 1, "reply-shape", f"a {k} reply of {len(frames)} frames")
        else:
            counts = body["entries"]
            ck.need(all(is_int(n) and n >= 1 for n in counts), "reply-shape", f"entries {counts!r}")
            ck.need(sum(counts) == len(frames) - 1, "reply-shape",
                    f"entries {counts!r} for {len(frames) - 1} frames")
            for topic, n in body["tseq"].items():
                ck.need(type(topic) is str and is_int(n), "reply-shape", f"tseq {topic!r}: {n!r}")
            at = 1
            for n in counts:
                entries.append(message(frames[at:at + n]))
                at += n
    except Malformed as exc:
        return Verdict(False, exc.rule, exc.why)
    return Verdict(True, kind=k, body=body, entries=tuple(entries))
