"""Every message kind round-trips; bad bytes get WireError and nothing else."""

from __future__ import annotations

import collections
import dataclasses
import datetime
import enum
import math
import re
import uuid

import msgpack
import numpy as np
import pytest
import torch
from helpers.wire_values import deepest_alone, nested

from offloop.bus.wire import (
    HEARTBEAT_TOPIC,
    VERSION,
    EventEncoder,
    Limits,
    WireError,
    decode_burst,
    decode_event,
    decode_reply,
    decode_request,
    encode_heartbeat,
    encode_reply,
    encode_request,
    event_frames,
)
from offloop.bus.wire.values import DEFAULT_LIMITS, DTYPE_SIZES, TENSOR_EXT, check_size

TENSORS = {
    "f32": torch.randn(3, 4),
    "f64": torch.randn(5, dtype=torch.float64),
    "f16": torch.tensor(1.5, dtype=torch.float16),
    "bf16": torch.randn(2, 2, 2).to(torch.bfloat16),
    "i64": torch.arange(10),
    "i8": torch.tensor([-3, 4], dtype=torch.int8),
    "u8": torch.zeros(0, 7, dtype=torch.uint8),
    "bool": torch.tensor([True, False, True]),
    "strided": torch.arange(12.0).reshape(3, 4).t(),
}


def encode(topic="batch_end", data=None, **kw):
    enc = EventEncoder("run-1", "pub-1", kw.get("rank", 0))
    return enc.encode(topic, kw.get("seq", 7), kw.get("tseq", 3), (1, 20, 4, 640, 0), data or {})


def test_event_round_trips_every_field():
    msg = decode_event(encode(data={"loss": 0.25, "lr": [0.1, 0.01], "name": "x", "none": None}))
    assert (msg.topic, msg.kind, msg.run, msg.pub, msg.rank) == ("batch_end", "ev", "run-1", "pub-1", 0)
    assert (msg.seq, msg.tseq, msg.ts) == (7, 3, (1, 20, 4, 640, 0))
    assert msg.data == {"loss": 0.25, "lr": [0.1, 0.01], "name": "x", "none": None}
    assert msg.t > 1e9


def test_tensors_of_several_dtypes_and_shapes_round_trip_as_raw_frames():
    frames = encode(data={"tensors": TENSORS, "nested": [{"t": TENSORS["i64"]}]})
    assert len(frames) == 1 + len(TENSORS) + 1  # one raw frame per tensor, no pickle
    msg = decode_event(frames)
    for name, tensor in TENSORS.items():
        got = msg.data["tensors"][name]
        assert got.dtype == str(tensor.dtype).removeprefix("torch.")
        assert got.shape == tuple(tensor.shape)
        assert torch.equal(got.to_torch(), tensor.contiguous()), name
    assert torch.equal(msg.data["nested"][0]["t"].to_torch(), TENSORS["i64"])


def test_tensor_bytes_are_not_copied_by_the_encoder():
    big = torch.zeros(256, 1024)  # 1 MiB
    frames = encode(data={"x": big})
    view = frames[1]
    assert isinstance(view, memoryview) and view.nbytes == big.numel() * 4
    big[0, 0] = 5.0  # the frame is a view of the tensor's own memory
    assert view[:4].cast("f")[0] == 5.0


def test_numpy_arrays_and_scalars_encode():
    import numpy as np

    msg = decode_event(encode(data={"a": np.arange(4, dtype=np.int32), "s": np.float32(2.5)}))
    assert msg.data["a"].to_numpy().tolist() == [0, 1, 2, 3]
    assert msg.data["s"] == 2.5


def test_unencodable_values_and_cuda_like_tensors_are_refused_clearly():
    with pytest.raises(WireError, match="not pickled"):
        encode(data={"obj": object()})

    class FakeCuda:
        dtype, shape = torch.float32, (1,)

        def detach(self):
            return self

        device = torch.device("meta")

    with pytest.raises(WireError, match="stage it to CPU"):
        encode(data={"t": FakeCuda()})


def test_heartbeat_round_trips():
    raw = encode_heartbeat("run-1", "pub-1", 1, 99, {"batch_end": 40}, drops=2, interval=0.5, beat=3)
    msg = decode_event([raw])
    assert msg.topic == HEARTBEAT_TOPIC and msg.kind == "hb"
    assert (msg.seq, msg.rank, msg.data["tseq"], msg.data["drops"], msg.data["beat"]) == (
        99, 1, {"batch_end": 40}, 2, 3)
    assert msg.data["final"] is False


@pytest.mark.parametrize(
    "kind,fields",
    [
        ("state_req", {"topics": ["batch_end"]}),
        ("info_req", {}),
        ("ctl", {"client": "c1", "req": 5, "op": "halt", "args": {"reason": "x"}, "t": 1.0}),
    ],
)
def test_requests_round_trip(kind, fields):
    body = decode_request(encode_request(kind, **fields))
    assert body["k"] == kind and all(body[k] == v for k, v in fields.items())


@pytest.mark.parametrize(
    "kind,fields",
    [
        ("state", {"run": "r", "pub": "p", "rank": 0, "seq": 3, "tseq": {"a": 1}, "beat": 2,
                   "config": {"lr": 0.1}, "entries": [1, 2]}),
        ("info", {"run": {"run_id": "r"}}),
        ("ack", {"client": "c", "req": 1, "op": "checkpoint", "ok": True,
                 "result": {"path": "/x.pt", "step": 10}, "error": None}),
        ("error", {"error": "nope"}),
    ],
)
def test_replies_round_trip(kind, fields):
    body = decode_reply(encode_reply(kind, **fields))
    assert body["k"] == kind and all(body[k] == v for k, v in fields.items())


FIELDS = ("v", "k", "run", "pub", "rank", "seq", "tseq", "t", "ts", "d")


def _body(**override):
    body = {"v": VERSION, "k": "ev", "run": "r", "pub": "p", "rank": 0, "seq": 1, "tseq": 1,
            "t": 1.0, "ts": [0, 0, 0, 0, 0], "d": {}}
    body.update(override)
    return b"batch_end\0" + msgpack.packb([body[f] for f in FIELDS])


ONE_BYTE = msgpack.ExtType(1, msgpack.packb([1, "uint8", [1]]))  # a tensor of frame 1


def _hb(**override):
    body = msgpack.unpackb(encode_heartbeat("r", "p", 0, 9, {"batch_end": 7}, 0, 0.5, 3)[4:])
    body.update(override)
    body = {k: v for k, v in body.items() if v is not None}
    return b"_hb\0" + msgpack.packb(body)


BAD_EVENTS = {
    "empty": [],
    "no topic": [b"\x81\xa1v\x01"],
    "not msgpack": [b"batch_end\0\xc1\xc1\xc1"],
    "truncated": [_body()[:-5]],
    "trailing bytes": [_body() + b"\x00"],
    "not an array": [b"batch_end\0" + msgpack.packb({"v": VERSION})],
    "short array": [b"batch_end\0" + msgpack.packb([1, 2])],
    "int time": [_body(t=1)],
    "wrong version": [_body(v=1)],  # what a publisher of an older build sends
    "no version": [b"batch_end\0" + msgpack.packb({"k": "ev"})],
    "bad field type": [_body(seq="7")],
    "bool as int": [_body(rank=True)],
    "bad ts": [_body(ts=[1, 2])],
    "unknown ext": [b"batch_end\0" + msgpack.packb({"v": VERSION, "x": msgpack.ExtType(9, b"")})],
    "tensor without frame": [b"batch_end\0" + msgpack.packb(
        {"v": VERSION, "d": msgpack.ExtType(1, msgpack.packb([1, "float32", [2]]))})],
    "tensor size mismatch": [
        _body(d={"t": msgpack.ExtType(1, msgpack.packb([1, "float32", [3]]))}), b"\0" * 8],
    "tensor bad dtype": [
        _body(d={"t": msgpack.ExtType(1, msgpack.packb([1, "object", [1]]))}), b"\0" * 8],
    "bad utf8 topic": [b"\xff\xfe\0" + msgpack.packb({"v": VERSION})],
    # the documented rules msgpack's own options let through (tests/e2e/test_fuzz.py's oracle)
    "kind not ev": [_body(k="hb")],
    "bin key in d": [_body(d={b"loss": 0.5})],
    "bin key nested in d": [_body(d={"x": [1, {"y": {b"k": 1}}]})],
    "msgpack timestamp in d": [_body(d={"at": msgpack.Timestamp(1, 0)})],
    "msgpack timestamp nested in d": [_body(d={"x": [[msgpack.Timestamp(1, 0)]]})],
    "tensor frame_index true": [_body(d={"x": msgpack.ExtType(1, msgpack.packb([True, "uint8", [1]]))}),
                                b"\x07"],
    "tensor shape of true": [_body(d={"x": msgpack.ExtType(1, msgpack.packb([1, "uint8", [True]]))}),
                             b"\x07"],
    "one frame, two tensors": [_body(d={"x": ONE_BYTE, "y": ONE_BYTE}), b"\x07"],
    "reserved topic": [b"_private" + _body()[len(b"batch_end"):]],
    "burst topic": [b"_burst" + _body()[len(b"batch_end"):]],
    "heartbeat kind not hb": [_hb(k="ev")],
    "heartbeat tseq not ints": [_hb(tseq={"batch_end": "seven"})],
    "heartbeat tseq bin key": [_hb(tseq={b"batch_end": 7})],
    "heartbeat t true": [_hb(t=True)],
    "heartbeat interval false": [_hb(interval=False)],
    "heartbeat field missing": [_hb(beat=None)],
    "heartbeat bin key": [_hb(**{"x": {b"k": 1}})],
    "heartbeat timestamp": [_hb(x=msgpack.Timestamp(1, 0))],
    "heartbeat with a tensor frame": [_hb(x=ONE_BYTE), b"\x07"],
    # each of ts's five counters checked, not only some of them
    **{f"ts[{i}] {kind}": [_body(ts=[0] * i + [bad] + [0] * (4 - i))]
       for i in range(5) for kind, bad in (("float", 1.5), ("bool", True))},
}


@pytest.mark.parametrize("name", sorted(BAD_EVENTS))
def test_bad_event_bytes_raise_wire_error(name):
    with pytest.raises(WireError):
        decode_event(BAD_EVENTS[name])


def test_oversized_messages_are_refused_before_decoding():
    limits = Limits(max_body_bytes=1024, max_frames=2, max_message_bytes=4096)
    with pytest.raises(WireError, match="limit is 1024"):
        decode_event([b"batch_end\0" + b"\xc1" * 2000], limits)  # invalid bytes never looked at
    with pytest.raises(WireError, match="frames"):
        decode_event([_body(), b"", b"", b""], limits)
    with pytest.raises(WireError, match="limit is 4096"):
        decode_event([_body(), b"\0" * 5000], limits)
    with pytest.raises(WireError, match="request is 2048 bytes, the limit is 1024"):
        decode_request(b"\x00" * 2048, Limits(max_request_bytes=1024))  # never looked at


def test_a_request_is_small_whatever_the_limits_on_events():
    """Issue 44: a 3.8 MiB body of four million small objects cost 0.6 s to decode; a
    request is now at most 16 KiB and none of its lists or maps longer than 1024."""
    assert DEFAULT_LIMITS.max_request_bytes == 16 << 10 < DEFAULT_LIMITS.max_body_bytes
    wide = encode_request("state_req", topics=None, pad=[0] * 20_000)
    with pytest.raises(WireError, match=f"request is {len(wide)} bytes, the limit is 16384"):
        decode_request(wide)
    many = encode_request("state_req", topics=[f"t{i}" for i in range(1025)])
    assert len(many) < 16 << 10
    with pytest.raises(WireError, match="1025 exceeds max_array_len"):
        decode_request(many)
    assert decode_request(encode_request("state_req", topics=[f"t{i}" for i in range(1024)]))


def test_deep_nesting_and_huge_declared_lengths_are_bounded():
    deep = b"batch_end\0" + b"\x91" * 100_000 + b"\x00"
    with pytest.raises(WireError):
        decode_event([deep])
    huge_array = b"batch_end\0" + b"\xdd\xff\xff\xff\xff"  # array32 claiming 4G items
    with pytest.raises(WireError):
        decode_event([huge_array])


def _ctl(**override):
    body = {"v": VERSION, "k": "ctl", "client": "c", "req": 1, "op": "halt", "args": {"reason": "r"},
            "t": 1.0}
    body.update(override)
    return msgpack.packb({k: v for k, v in body.items() if v is not None})


@pytest.mark.parametrize("raw", [b"", b"\xc1", msgpack.packb({"v": 1, "k": "nope"}),
                                 msgpack.packb({"v": 3, "k": "ctl"}),
                                 msgpack.packb({"v": 1, "k": "ctl", "client": "c", "req": "1",
                                                "op": "halt", "args": {}})])
def test_bad_requests_raise_wire_error(raw):
    with pytest.raises(WireError):
        decode_request(raw)


@pytest.mark.parametrize("raw,field", [
    (msgpack.packb({"v": VERSION, "k": "state_req"}), "'topics' is missing"),
    (encode_request("state_req", topics=[1]), "'topics'"),
    (encode_request("state_req", topics="batch_end"), "'topics'"),
    (_ctl(t=None), "'t' is missing"),
    (_ctl(t=1), "'t'"),
    (_ctl(t=True), "'t'"),
    (_ctl(op="fly", args={}, t=None), "'t' is missing"),  # an unknown op carries t too
    (_ctl(args={}), "halt args field 'reason' is missing"),
    (_ctl(args={"reason": 5}), "'reason' is 5"),
    (_ctl(op="checkpoint", args={}), "checkpoint args field 'tag' is missing"),
    (_ctl(op="checkpoint", args={"tag": b"x"}), "'tag'"),
    (_ctl(op="checkpoint", args={"tag": "x", "filename": 5}), "'filename' is 5"),
    (_ctl(args={"reason": "r", b"x": 1}), "map key b'x'"),
    (_ctl(args={"reason": "r", "at": msgpack.Timestamp(1, 0)}), "timestamp"),
    (msgpack.packb({"v": VERSION, "k": "info_req", "x": {b"k": 1}}), "map key b'k'"),
])
def test_requests_breaking_a_documented_rule_name_the_field(raw, field):
    with pytest.raises(WireError, match=re.escape(field)):
        decode_request(raw)


@pytest.mark.parametrize("raw", [
    encode_request("state_req", topics=None),  # every topic
    encode_request("info_req", topics=0),  # a field info_req does not have is not read
    encode_request("info_req", anything={"x": [1, None]}),
    _ctl(args={"reason": "r", "by": "someone"}),  # a field added to args
    _ctl(op="checkpoint", args={"tag": "", "filename": None}),
    _ctl(op="checkpoint", args={"tag": "t", "filename": "../not/plain"}),  # refused, not malformed
    _ctl(op="fly", args={"anything": b"x"}),  # an unknown op: refused, ok false, by the server
])
def test_requests_the_docs_allow_decode(raw):
    assert decode_request(raw)["k"] in ("state_req", "info_req", "ctl")


# ----------------------------------------------------------------------- bursts


def burst_events(n=3):
    return [[topic, seq, seq, 1.5 + seq, (0, seq, seq, 8 * seq, 0), data] for seq, (topic, data) in enumerate(
        [("batch_start", {"batch_size": 8}), ("after_loss", {"loss": TENSORS["f32"]}),
         ("batch_end", {"loss": 0.5, "t": [TENSORS["bf16"], TENSORS["strided"]]}),
         ("eval_end", {"metrics": {"acc": 0.75}})][:n], start=1)]


def test_a_burst_round_trips_its_events_in_order_with_their_tensors():
    enc = EventEncoder("run-1", "pub-1", 2)
    (frames,) = enc.bursts(burst_events(4))
    assert frames[0].startswith(b"_burst\0") and len(frames) == 1 + 3  # tensors of every event, in order
    msgs = decode_burst(frames)
    assert [(m.topic, m.seq, m.tseq, m.t, m.ts) for m in msgs] == [
        (e[0], e[1], e[2], e[3], e[4]) for e in burst_events(4)]
    assert all((m.run, m.pub, m.rank, m.kind, m.raw) == ("run-1", "pub-1", 2, "ev", None) for m in msgs)
    assert torch.equal(msgs[1].data["loss"].to_torch(), TENSORS["f32"])
    bf16, strided = msgs[2].data["t"]
    assert torch.equal(bf16.to_torch(), TENSORS["bf16"]) and torch.equal(strided.to_torch(), TENSORS["strided"].contiguous())
    # framed alone again (what a recorder stores), each decodes as the event it was
    for msg in msgs:
        alone = decode_event(event_frames(msg))
        assert (alone.topic, alone.seq, alone.tseq, alone.t, alone.ts) == (msg.topic, msg.seq, msg.tseq, msg.t, msg.ts)


def test_a_burst_past_the_size_limits_is_split_and_loses_nothing():
    enc = EventEncoder("run-1", "pub-1", 0)
    ts = (0, 1, 1, 1, 0)  # one ts for all: every part but the first must carry it again
    events = [[("batch_end", "eval_end")[i % 2], i, (i + 1) // 2, 1.0, ts, {"pad": b"x" * 1000, "t": torch.arange(4)}]
              for i in range(1, 41)]
    limits = Limits(max_body_bytes=8 << 10, max_frames=8)
    bursts = enc.bursts(events, limits)
    assert len(bursts) >= 5
    for frames in bursts:
        assert len(frames[0]) <= limits.max_body_bytes and len(frames) - 1 <= limits.max_frames
    got = [m for frames in bursts for m in decode_burst(frames, limits)]
    assert [(m.topic, m.seq, m.tseq, m.ts) for m in got] == [(e[0], e[1], e[2], ts) for e in events]
    assert all(m.data["t"].to_torch().tolist() == [0, 1, 2, 3] for m in got)


def test_a_burst_carries_ts_once_where_events_share_it_and_numbers_its_events():
    enc = EventEncoder("run-1", "pub-1", 0)
    a, b = (0, 1, 1, 8, 0), (0, 2, 2, 16, 0)
    events = [["batch_start", 11, 5, 1.0, a, {}], ["after_loss", 12, 5, 1.1, a, {"loss": 0.5}],
              ["batch_end", 13, 5, 1.2, b, {}], ["batch_start", 14, 6, 1.3, b, {}]]
    (frames,) = enc.bursts(events)
    body = msgpack.unpackb(frames[0][len(b"_burst\0"):])
    assert body[5:7] == [11, {"batch_start": 5, "after_loss": 5, "batch_end": 5}]
    assert [len(entry) for entry in body[7]] == [4, 3, 4, 3]  # ts where it changes, and first
    assert [(m.topic, m.seq, m.tseq, m.t, m.ts, m.data) for m in decode_burst(frames)] == [
        (e[0], e[1], e[2], e[3], e[4], e[5]) for e in events]


def test_unencodable_events_are_found_one_by_one():
    enc = EventEncoder("run-1", "pub-1", 0)
    events = burst_events(3)
    events[1] = ["after_loss", 2, 2, 1.0, (0, 0, 0, 0, 0), {"odd": object()}]
    with pytest.raises(WireError):
        enc.bursts(events)
    good, bad = enc.split_unencodable(events)
    assert [e[1] for e in good] == [1, 3] and [e[1] for e, _ in bad] == [2]
    assert "not pickled" in bad[0][1]
    bursts = enc.bursts(good)  # seq 2 is missing: a burst numbers consecutive events only
    assert len(bursts) == 2 and [m.seq for frames in bursts for m in decode_burst(frames)] == [1, 3]


def test_what_the_packer_refuses_is_a_wire_error_and_is_found_at_the_depth_a_burst_packs_it():
    enc = EventEncoder("run-1", "pub-1", 0)
    for odd in ({"deep": nested(5000)}, {"huge": 2**64}, {"key": {1: 2}}, {"s": "\ud800"}):
        with pytest.raises(WireError, match="cannot encode"):
            enc.encode("batch_end", 1, 1, (0, 0, 0, 0, 0), odd)
    # deep enough to fail only inside a burst (two levels below a single event's body)
    depth = deepest_alone()
    assert depth > 100
    events = burst_events(1) + [["batch_end", 2, 1, 1.0, (0, 0, 0, 0, 0), {"deep": nested(depth)}]]
    assert enc.encode("batch_end", 2, 1, (0, 0, 0, 0, 0), events[1][5])  # alone it fits
    with pytest.raises(WireError):
        enc.bursts(events)
    good, bad = enc.split_unencodable(events)
    assert [e[1] for e in good] == [1] and [e[1] for e, _ in bad] == [2]


def test_what_msgpacks_packer_took_travels_as_its_plain_value_and_the_rest_is_refused_by_name():
    class Level(enum.IntEnum):
        HIGH = 3

    class Mode(str, enum.Enum):
        FAST = "fast"

    Pair = collections.namedtuple("Pair", "a b")
    data = {"level": Level.HIGH, "mode": Mode.FAST, "pair": Pair(1, 2.5), "f64": np.float64(0.5),
            "i64": np.int64(-7), "flag": np.bool_(True), "ordered": collections.OrderedDict(a=1),
            "raw": bytearray(b"ab"), "view": memoryview(b"cd"), "u64": 2**64 - 1, "nan": math.nan}
    m = decode_event(EventEncoder("r", "p", 0).encode("batch_end", 1, 1, (0, 0, 0, 0, 0), data))
    assert m.data["level"] == 3 and type(m.data["level"]) is int
    assert m.data["mode"] == "fast" and m.data["pair"] == [1, 2.5] and m.data["f64"] == 0.5
    assert m.data["i64"] == -7 and m.data["flag"] is True and m.data["ordered"] == {"a": 1}
    assert m.data["raw"] == b"ab" and m.data["view"] == b"cd" and m.data["u64"] == 2**64 - 1
    assert math.isnan(m.data["nan"])
    enc = EventEncoder("r", "p", 0)
    for value, name in ((datetime.datetime(2026, 1, 1), "datetime"), ({1, 2}, "set"),
                        (uuid.UUID(int=1), "UUID"), (enum.Enum("Color", "RED").RED, "Color"),
                        (_Point(1, 2), "_Point"), (1j, "complex")):
        with pytest.raises(WireError, match=f"cannot encode {name} on the wire"):
            enc.encode("batch_end", 1, 1, (0, 0, 0, 0, 0), {"x": value})
    with pytest.raises(WireError, match="an int past 64 bits"):
        enc.encode("batch_end", 1, 1, (0, 0, 0, 0, 0), {"x": -2**63 - 1})
    assert enc.encode("batch_end", 1, 1, (0, 0, 0, 0, 0), {"x": 1})  # a refusal leaves nothing behind


@dataclasses.dataclass
class _Point:
    x: int
    y: int


def _burst(body, *frames):
    return [b"_burst\0" + msgpack.packb(body), *frames]


def _bu(events, seq=1, tseq=None, *, v=VERSION, kind="bu"):
    """A burst body: events as they go on the wire, [topic, t, d(, ts)]."""
    return [v, kind, "r", "p", 0, seq, {"batch_end": 1} if tseq is None else tseq, events]


TS = [0, 1, 1, 8, 0]
GOOD_EVENT = ["batch_end", 1.0, {}, TS]
TENSOR = {"t": msgpack.ExtType(1, msgpack.packb([1, "int64", [2]]))}
BAD_BURSTS = {
    "not a burst": [b"batch_end\0" + msgpack.packb([1])],
    "not an array": _burst({"v": VERSION}),
    "short header": _burst(_bu([GOOD_EVENT])[:7]),
    "wrong version": _burst(_bu([GOOD_EVENT], v=1)),  # what a publisher of an older build sends
    "wrong kind": _burst(_bu([GOOD_EVENT], kind="ev")),
    "seq not an int": _burst(_bu([GOOD_EVENT], seq="1")),
    "tseq not a map": _burst(_bu([GOOD_EVENT], tseq=[1])),
    "tseq not an int": _burst(_bu([GOOD_EVENT], tseq={"batch_end": 1.0})),
    "reserved topic in tseq": _burst(_bu([["_hb", 1.0, {}, TS]], tseq={"_hb": 1})),
    "topic not in tseq": _burst(_bu([["eval_end", 1.0, {}, TS]])),
    "events not a list": _burst(_bu({"a": 1})),
    "event too short": _burst(_bu([GOOD_EVENT[:2]])),
    "event too long": _burst(_bu([[*GOOD_EVENT, 1]])),
    "topic not a string": _burst(_bu([[7, 1.0, {}, TS]])),
    "first event without ts": _burst(_bu([GOOD_EVENT[:3]])),
    "t not a float": _burst(_bu([["batch_end", 1, {}, TS]])),
    "d not a map": _burst(_bu([["batch_end", 1.0, [1], TS]])),
    "ts too short": _burst(_bu([["batch_end", 1.0, {}, [0, 1]]])),
    "ts of floats": _burst(_bu([GOOD_EVENT, ["batch_end", 1.0, {}, [0.0, 1, 1, 8, 0]]])),
    "tensor frame missing": _burst(_bu([["batch_end", 1.0, TENSOR, TS]])),
    "tensor frame unused": _burst(_bu([GOOD_EVENT]), b"\0" * 8),
    "tensor frame too short": _burst(_bu([["batch_end", 1.0, TENSOR, TS]]), b"\0" * 8),
    "truncated": [_burst(_bu([GOOD_EVENT]))[0][:-4]],
    "bin key in d": _burst(_bu([GOOD_EVENT, ["batch_end", 2.0, {"x": {b"k": 1}}]])),
    "msgpack timestamp in d": _burst(_bu([GOOD_EVENT, ["batch_end", 2.0, {"at": msgpack.Timestamp(1, 0)}]])),
    "one frame, two tensors": _burst(_bu([["batch_end", 1.0, TENSOR, TS], ["batch_end", 2.0, TENSOR]]),
                                     b"\0" * 16),
    "tensor shape of true": _burst(_bu([["batch_end", 1.0, {"t": msgpack.ExtType(
        1, msgpack.packb([1, "int64", [True]]))}, TS]]), b"\0" * 8),
}


@pytest.mark.parametrize("name", sorted(BAD_BURSTS))
def test_bad_bursts_raise_wire_error(name):
    with pytest.raises(WireError):
        decode_burst(BAD_BURSTS[name])
    # the same burst, well formed, decodes; nil for d is an event without fields
    msgs = decode_burst(_burst(_bu([GOOD_EVENT, ["batch_end", 2.0, None]])))
    assert [(m.topic, m.seq, m.tseq, m.ts, m.data) for m in msgs] == [
        ("batch_end", 1, 1, tuple(TS), {}), ("batch_end", 2, 2, tuple(TS), {})]


# -------------------- guarantees at their edges --------------------
# Folded from test_wire_values_guarantees.py (marked `guarantee`: mutation/*.toml select them).
# What the wire's value layer (bus/wire/values.py) guarantees and mutation testing found
# no test pinning: each dtype's size, the zero copy, a tensor frame referred to exactly once,
# the size limits at their boundaries, and errors that name the frame or field at fault.

VALUES_TS = (0, 1, 1, 32, 0)


def _encode(data: dict) -> list:
    return EventEncoder("run", "pub", 0).encode_event(["batch_end", 1, 1, 0.5, VALUES_TS, data])


def _descriptor(index, dtype: str = "float32", shape=(1,)) -> msgpack.ExtType:
    return msgpack.ExtType(TENSOR_EXT, msgpack.packb([index, dtype, list(shape)]))


def _crafted(data: dict, tensor_frames: list) -> list:
    """A valid event's frames with `data` put in its body as is (tensor descriptors made by
    `_descriptor`, however wrong) and `tensor_frames` after it."""
    head = bytes(_encode({})[0])
    cut = head.index(b"\0") + 1
    body = msgpack.unpackb(head[cut:], raw=False)
    body[-1] = data
    return [head[:cut] + msgpack.packb(body, use_bin_type=True), *tensor_frames]


@pytest.mark.guarantee
@pytest.mark.parametrize("dtype", sorted(DTYPE_SIZES))
def test_every_dtype_travels_with_its_size(dtype):
    source = (torch.arange(6) % 2).to(getattr(torch, dtype)).reshape(2, 3)
    received = decode_event(_encode({"x": source})).data["x"]
    assert received.dtype == dtype and received.shape == (2, 3)
    assert received.nbytes == 6 * DTYPE_SIZES[dtype] == len(received.data)
    assert torch.equal(received.to_torch(), source)


@pytest.mark.guarantee
def test_a_contiguous_array_is_sent_without_a_copy_and_a_strided_one_as_its_values():
    contiguous = np.arange(12, dtype=np.float32).reshape(3, 4)
    frames = _encode({"c": contiguous, "t": contiguous.T})
    assert any(np.shares_memory(np.frombuffer(frame, dtype=np.float32), contiguous)
               for frame in frames[1:])
    data = decode_event(frames).data
    assert np.array_equal(data["c"].to_numpy(), contiguous)
    assert np.array_equal(data["t"].to_numpy(), contiguous.T)


@pytest.mark.guarantee
def test_a_tensor_frame_referred_to_twice_is_refused_by_its_number():
    frames = _crafted({"a": _descriptor(1), "b": _descriptor(1)}, [bytes(4), bytes(4)])
    with pytest.raises(WireError, match=r"^tensor frame 1 is referred to by 2 tensor descriptors; each "
                                        r"of the message's 2 tensor frames must be referred to by exactly one$"):
        decode_event(frames)


@pytest.mark.guarantee
def test_a_tensor_frame_referred_to_by_none_is_refused_by_its_number():
    frames = _crafted({"a": _descriptor(1)}, [bytes(4), bytes(4)])
    with pytest.raises(WireError, match=r"^tensor frame 2 is referred to by 0 tensor descriptors; each "
                                        r"of the message's 2 tensor frames"):
        decode_event(frames)


@pytest.mark.guarantee
@pytest.mark.parametrize("index", [0, 2])
def test_a_frame_index_outside_the_tensor_frames_is_named(index):
    frames = _crafted({"a": _descriptor(index)}, [bytes(4)])
    with pytest.raises(WireError, match=rf"^tensor frame_index {index} is not an int naming one of the "
                                        r"message's 1 tensor frames \(1\.\.1\)$"):
        decode_event(frames)


@pytest.mark.guarantee
def test_an_empty_dimension_is_a_tensor_and_a_negative_one_is_refused():
    empty = decode_event(_crafted({"a": _descriptor(1, shape=(0, 3))}, [b""])).data["a"]
    assert empty.shape == (0, 3) and empty.nbytes == 0
    with pytest.raises(WireError, match=r"shape \[-1\] is not a list of non-negative ints"):
        decode_event(_crafted({"a": _descriptor(1, shape=(-1,))}, [b""]))


@pytest.mark.guarantee
def test_an_extension_value_is_named_with_or_without_tensor_frames():
    with pytest.raises(WireError, match="body refers to a tensor frame, but the message has none"):
        decode_event(_crafted({"a": _descriptor(1)}, []))
    for tensor_frames in ([], [bytes(4)]):
        data = {"a": msgpack.ExtType(5, b"x")} | ({"b": _descriptor(1)} if tensor_frames else {})
        with pytest.raises(WireError, match="unknown msgpack ext type 5"):
            decode_event(_crafted(data, tensor_frames))


@pytest.mark.guarantee
def test_frames_as_bytes_or_buffers_decode_alike():
    frames = _encode({"x": torch.arange(4, dtype=torch.int32)})
    head, tensor = bytes(frames[0]), bytes(frames[1])
    for mixed in ([head, tensor], [memoryview(head), memoryview(tensor)],
                  [memoryview(head), tensor], [head, memoryview(tensor)]):
        message = decode_event(mixed)
        assert message.topic == "batch_end" and message.from_state is False
        assert message.data["x"].to_torch().tolist() == [0, 1, 2, 3]


@pytest.mark.guarantee
def test_the_default_body_limit_is_4_mib_exactly():
    limit = 4 << 20
    probe = len(_encode({"s": "x" * limit})[0])
    fits = _encode({"s": "x" * (2 * limit - probe)})
    assert len(fits[0]) == limit
    assert decode_event(fits).topic == "batch_end"
    too_big = _encode({"s": "x" * (2 * limit - probe + 1)})
    with pytest.raises(WireError, match=rf"message body is {limit + 1} bytes, the limit is {limit}"):
        decode_event(too_big)


class _Sized:
    """A frame known by its length alone: the message limit is checked before any byte is read."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


@pytest.mark.guarantee
def test_the_default_message_limit_is_256_mib_exactly():
    limit = 256 << 20
    check_size([b"x", _Sized(limit - 1)])
    with pytest.raises(WireError, match=rf"message is {limit + 1} bytes, the limit is {limit}"):
        check_size([b"x", _Sized(limit)])
    check_size([b"x", _Sized(9)], Limits(max_message_bytes=10))


@pytest.mark.guarantee
def test_limits_cannot_be_changed_in_place():
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT_LIMITS.max_body_bytes = 1  # shared by every decoder in the process
