"""Bad input: random and mutated bytes at a training run's control socket, at a
publisher's state socket, and from a rogue publisher into a subscriber. Nothing
crashes, nothing reaches the trainer, every bad message is counted; oversized ones are
dropped by libzmq before any decoding. Figures: `pytest -s`, quoted in docs/reliability.md.

What is malformed is not decided by the decoders under test: `helpers.wire_oracle` states
the wire rules of docs/protocol.md on its own, and every example holds the product's verdict
(decoded to these fields / refused and counted / this reply) to the oracle's for the same
bytes, both ways. A documented rule found unenforced goes into `KNOWN`, which the fuzz tests
waive (and only those), until the product enforces it: the 14 found this way are enforced
now, each with a regression test in tests/bus/test_wire.py or test_control.py."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time

import msgpack
import numpy as np
import pytest
import torch
import zmq
from helpers import wire_oracle
from helpers.figures import report
from helpers.waiting import wait_until
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset

from offloop.bus import ControlClient, Publisher, Subscriber, WireError
from offloop.bus import control as bus_control
from offloop.bus.wire import (
    VERSION,
    EventEncoder,
    Message,
    TensorFrame,
    decode_burst,
    decode_event,
    encode_heartbeat,
    encode_request,
)
from offloop.bus.wire.values import BURST_PREFIX
from offloop.trainer import Trainer

EXAMPLES = 3000
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))




# ----------------------------------------------------- the oracle, and where it is waived

#: Documented wire rules the product does not enforce (docs/protocol.md, unless said), by
#: the oracle's rule name, with why. The fuzz tests hold the product to the oracle with
#: these rules, and only these, waived, and report how often each came up.
KNOWN: dict[str, str] = {}  # none left: each rule listed here once is enforced now


def judged(judge, frames: list[bytes]) -> tuple[wire_oracle.Verdict, str | None]:
    """The oracle's verdict on `frames` with the rules in KNOWN waived (or, for a check the
    product adds, imposed), and the known rule that changed the verdict (else None)."""
    strict = judge(frames)
    known = judge(frames, waive=KNOWN, impose=KNOWN)
    if bool(strict) == bool(known):
        return strict, None
    return known, (known.rule if strict else strict.rule)


def same(a, b) -> bool:
    """Equal values and equal types (True is not 1), NaN equal to NaN, a decoded
    TensorFrame equal to the oracle's Tensor with its dtype, shape and bytes."""
    if type(a) is TensorFrame:
        a = wire_oracle.Tensor(a.dtype, a.shape, bytes(a.data))
    if type(a) is not type(b):
        return False
    if type(a) is float:
        return a == b or (a != a and b != b)
    if type(a) is dict:
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if type(a) in (list, tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def same_event(msg: Message, event: wire_oracle.Event) -> bool:
    """A decoded Message carries what the oracle says a reader decodes (a heartbeat's tseq
    and ts are the product's own zeros: the docs give a heartbeat neither)."""
    return (msg.topic, msg.kind, msg.run, msg.pub, msg.rank, msg.seq) == (
        event.topic, event.kind, event.run, event.pub, event.rank, event.seq) and \
        same(msg.t, event.t) and same(msg.data, event.d) and \
        (event.kind == "hb" or (msg.tseq, msg.ts) == (event.tseq, event.ts))


# ------------------------------------------------------------------------- mutations

MUTATIONS = ("flip", "set", "insert", "delete", "truncate", "append", "dup")


@st.composite
def mutate(draw, data: bytes) -> bytes:
    """One to four byte-level edits of `data`."""
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(MUTATIONS))
        if not out:
            out += b"\x00"
        pos = draw(st.integers(0, len(out) - 1))
        if kind == "flip":
            out[pos] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set":
            out[pos] = draw(st.sampled_from([0x00, 0x7F, 0x80, 0xC1, 0xC0, 0xCC, 0xD9, 0xDC,
                                             0xDD, 0xDE, 0xDF, 0xFF, 0x90, 0x9A, 0xA0]))
        elif kind == "insert":
            out[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif kind == "delete":
            del out[pos : pos + draw(st.integers(1, 8))]
        elif kind == "truncate":
            del out[pos:]
        elif kind == "append":
            out += draw(st.binary(min_size=1, max_size=16))
        else:
            end = min(len(out), pos + draw(st.integers(1, 16)))
            out[pos:pos] = out[pos:end]
    return bytes(out)


SCALARS = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
           | st.text(max_size=12) | st.binary(max_size=12))
ANY = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                   | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=5)

# hand-written nasties: deep nesting, lengths that promise more than is there, ext types
# (a tensor descriptor where none is allowed), non-string keys, a body of nothing
NASTIES = [
    b"", b"\x00", b"\xc1", b"\x91" * 5000 + b"\xc0", b"\xdd\xff\xff\xff\xff",
    b"\xdf\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff",
    msgpack.packb({1: 2}), msgpack.packb(msgpack.ExtType(1, msgpack.packb([1, "float32", [1]]))),
    msgpack.packb({"v": VERSION, "k": "ctl", "client": "c", "req": 1, "op": "halt",
                   "args": msgpack.ExtType(1, b"\x93\x01\xa7float32\x91\x01")}),
    msgpack.packb([1] * 100_001)[:4000], msgpack.packb([1] * 1025), msgpack.packb({"v": VERSION - 1, "k": "ctl"}), b"\x80" * 64,
]
NASTY = st.integers(0, len(NASTIES) - 1).map(NASTIES.__getitem__)  # by index: short reprs


# -------------------------------------------------------------- the control socket

VALID_OPS = st.sampled_from(["halt", "checkpoint"])
REQUESTS = st.builds(
    lambda client, req, op, text: encode_request(
        "ctl", client=client, req=req, op=op,
        args={"reason": text} if op == "halt" else {"tag": text}, t=1.0),
    st.text(max_size=12), st.integers(0, 2**40), VALID_OPS, st.text(max_size=12))
UNKNOWN_OPS = st.builds(  # few keys, so that retries of refused requests come up too
    lambda client, req, op: encode_request("ctl", client=client, req=req, op=op, args={}, t=1.0),
    st.sampled_from(["a", "b"]), st.integers(0, 9),
    st.text(max_size=8).filter(lambda op: op not in ("halt", "checkpoint")))
STRUCTURED_FIELDS = dict(
    optional={"client": st.text(max_size=8) | ANY, "req": st.integers(0, 99) | ANY,
              "op": st.sampled_from(["halt", "checkpoint", "fly", ""]) | ANY,
              "args": st.dictionaries(st.text(max_size=6), ANY, max_size=3) | ANY, "t": ANY,
              "topics": st.none() | st.lists(st.sampled_from(["fit_start", "epoch_start", "x"])
                                             | st.text(max_size=4), max_size=3) | ANY},
)
KINDS = st.sampled_from(["ctl", "state_req", "info_req", "ack"]) | ANY
STRUCTURED_REQUESTS = st.fixed_dictionaries({"v": st.just(1) | ANY, "k": KINDS},
                                            **STRUCTURED_FIELDS).map(msgpack.packb)
# the version spoken, so that more of them are valid, or nearly
STRUCTURED_V2_REQUESTS = st.fixed_dictionaries({"v": st.just(VERSION), "k": KINDS},
                                               **STRUCTURED_FIELDS).map(msgpack.packb)


@st.composite
def near_request(draw, body: dict) -> bytes:
    """`body` with one field deleted, or given a value of a neighbouring type or at an edge."""
    body = dict(body)
    key = draw(st.sampled_from(sorted(body)))
    near = [1, 2, 2**64 - 1, -1, True, 1.0, "2", "", b"x", None, [], {}, ["a"], [b"a"], {"reason": 5}]
    if draw(st.integers(0, 4)) == 0:
        del body[key]
    else:
        body[key] = draw(st.sampled_from(near))
    return msgpack.packb(body)


NEAR_CONTROL = st.sampled_from([  # refused ops and retries of them; a halt, valid or nearly
    {"v": VERSION, "k": "ctl", "client": "n", "req": 1, "op": "fly", "args": {}, "t": 1.0},
    {"v": VERSION, "k": "ctl", "client": "n", "req": 2, "op": "halt", "args": {"reason": "r"}, "t": 1.0},
]).flatmap(near_request)
CONTROL_INPUTS = st.one_of(
    st.binary(max_size=300).map(lambda b: [b]),
    NEAR_CONTROL.map(lambda b: [b]),
    REQUESTS.flatmap(mutate).map(lambda b: [b]),
    STRUCTURED_REQUESTS.map(lambda b: [b]),
    STRUCTURED_V2_REQUESTS.map(lambda b: [b]),
    UNKNOWN_OPS.map(lambda b: [b]),
    NASTY.map(lambda b: [b]),
    st.lists(st.binary(max_size=40) | REQUESTS, min_size=2, max_size=4),  # not one frame
    # as a relay sends it, [client, b"", body]: a client of 0 or 256 bytes breaks the layout
    st.tuples(st.binary(max_size=256), UNKNOWN_OPS | NEAR_CONTROL | REQUESTS.flatmap(mutate)).map(
        lambda pair: [pair[0], b"", pair[1]]),
)


def expected_at_the_control_server(frames: list[bytes], refused: dict):
    """What the server must do with one DEALER message, by the oracle: 'malformed',
    'refused' (a readable request for an op that does not exist), 'duplicate' (a retry of one
    refused before), or None for a valid halt or checkpoint request, which this test does not
    send; with the request's body (None when malformed), the known rule waived, if any, and
    the envelope a relayed request's answer comes back behind."""
    verdict, waived = judged(wire_oracle.control, frames)
    if not verdict:
        return "malformed", None, waived, verdict.envelope
    body = verdict.body
    if body["op"] in wire_oracle.CONTROL_OPS:
        return None, body, waived, verdict.envelope
    return (("duplicate" if (body["client"], body["req"]) in refused else "refused"), body, waived,
            verdict.envelope)


class Loading(TensorDataset):
    """Each batch spends 2 ms loading (as from disk), so the training thread leaves the
    interpreter to the control thread now and then, as a real data pipeline does."""

    def __getitem__(self, index):
        if index % 8 == 0:
            time.sleep(0.002)
        return super().__getitem__(index)


@contextlib.contextmanager
def training(tmp_path):
    """A real Trainer training in a thread (until halted), its control poll() recorded."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4000, 8, generator=gen)
    trainer = Trainer(torch.nn.Linear(8, 3), DataLoader(Loading(x, (x[:, 0] > 0).long()),
                                                        batch_size=8),
                      "10000000ba", loss_fn=torch.nn.functional.cross_entropy,
                      run_dir=tmp_path / "run")
    polled: list = []
    real_poll = trainer.control.poll

    def recording_poll():
        got = real_poll()
        polled.extend(got)
        return got

    trainer.control.poll = recording_poll
    fit = threading.Thread(target=trainer.fit, daemon=True)
    fit.start()
    try:
        wait_until(lambda: trainer.timestamp.batch >= 5, 60, "training to start")
        yield trainer, polled
        assert not trainer.controller.stop and trainer.stopped_by is None and not trainer.checkpoints
        # the server thread is alive and a valid request is applied and acknowledged
        at = trainer.timestamp.batch
        with ControlClient(trainer.control.endpoint) as client:
            ack = client.halt("valid, after the fuzz", timeout=60)
        assert ack.ok and ack.result["step"] > at  # training went on throughout
        fit.join(60)
        assert not fit.is_alive() and trainer.stopped_by["reason"] == "valid, after the fuzz"
        assert [(r.op, r.args) for r in polled] == [("halt", {"reason": "valid, after the fuzz"})]
    finally:
        if fit.is_alive():
            trainer.controller.stop = True
            fit.join(30)
        trainer.close()


@pytest.mark.timeout(300)  # thousands of examples; ~20-60 s on a busy 2-core machine
def test_random_and_mutated_control_messages_are_counted_and_never_reach_the_trainer(tmp_path):
    with training(tmp_path) as (trainer, polled):
        server = trainer.control
        ctx = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.linger = 0
        dealer.connect(server.endpoint)
        refused: dict = {}  # (client, req) -> the op of the request first refused with it
        tried = {"malformed": 0, "refused": 0, "duplicate": 0, "valid, not sent": 0}

        @FUZZ
        @given(CONTROL_INPUTS)
        @example([msgpack.packb({"v": 1, "k": []})])  # an unhashable kind once killed the server
        def one(frames):
            expect, body, waived, envelope = expected_at_the_control_server(frames, refused)
            if waived:
                tried[f"known: {waived}"] = tried.get(f"known: {waived}", 0) + 1
            if expect is None:
                tried["valid, not sent"] += 1
                return
            assert server._thread.is_alive(), "the control server thread died"
            before = dataclasses.replace(server.stats)
            dealer.send_multipart(frames)
            if len(frames) == 1 or envelope:  # a request is answered: an error, or a refusal
                assert dealer.poll(10_000), "the control server stopped answering"
                answer = dealer.recv_multipart()
                assert tuple(answer[:-1]) == envelope, "the answer is not routed behind the request's envelope"
                reply = wire_oracle.reply(answer[-1:])
                assert reply, f"the server's reply breaks the documented layout: {reply.why}"
                if expect == "malformed":
                    assert reply.kind == "error"
                else:  # the ack names the request it answers: a duplicate gets the stored one
                    key = (body["client"], body["req"])
                    op = body["op"] if expect == "refused" else refused[key]
                    assert reply.kind == "ack" and reply.body["ok"] is False
                    assert (reply.body["client"], reply.body["req"], reply.body["op"]) == (*key, op)
            else:
                wait_until(lambda: server.stats.malformed > before.malformed, 10,
                           "the server to count a multi-frame message")
            after = server.stats
            assert after.malformed == before.malformed + (expect == "malformed")
            assert after.refused == before.refused + (expect == "refused")
            assert after.duplicates == before.duplicates + (expect == "duplicate")
            assert after.received == before.received + (expect != "malformed")
            assert after.acked == 0 and polled == []  # nothing reached the trainer
            if expect == "refused":
                refused[(body["client"], body["req"])] = body["op"]
            tried[expect] += 1

        try:
            one()
        finally:  # closed on a failure too: a context left with open sockets hangs at exit
            dealer.close()
            ctx.term()
        sent = tried["malformed"] + tried["refused"] + tried["duplicate"]
        assert sent >= EXAMPLES * 0.9 and tried["malformed"] >= EXAMPLES * 0.8
        stats = server.stats
        assert stats.malformed == tried["malformed"]
        assert stats.refused == tried["refused"] and stats.duplicates == tried["duplicate"]
        report("control_fuzz", examples=sum(n for k, n in tried.items() if not k.startswith("known")),
               sent=sent, **tried,
               counted_malformed=stats.malformed, counted_refused=stats.refused,
               counted_duplicates=stats.duplicates, reached_trainer=len(polled))


def test_an_oversized_control_message_is_counted_and_refused_before_decoding(
        tmp_path, monkeypatch):
    decoded: list[int] = []
    real_decode = bus_control.decode_request

    def counting_decode(frame, limits=bus_control.DEFAULT_LIMITS):
        decoded.append(len(frame))
        return real_decode(frame, limits)

    monkeypatch.setattr(bus_control, "decode_request", counting_decode)
    with training(tmp_path) as (trainer, polled):
        server = trainer.control
        limit = server.limits.max_request_bytes
        ctx = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.linger = 0
        events = dealer.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        dealer.connect(server.endpoint)
        assert events.poll(30_000) and _event(events) == zmq.EVENT_CONNECTED

        # at the limit: read, decoded, refused as malformed and answered
        dealer.send(b"\xc1" * limit)
        assert dealer.poll(30_000) and msgpack.unpackb(dealer.recv())["k"] == "error"
        assert server.stats.malformed == 1 and decoded == [limit]

        # over the limit: counted and refused by its length, never decoded
        dealer.send(encode_request("ctl", client="big", req=1, op="halt",
                                   args={"reason": "x" * limit}, t=1.0))
        assert dealer.poll(30_000) and "the limit is" in msgpack.unpackb(dealer.recv())["error"]
        assert server.stats.oversized == 1 and server.stats.received == 0 and decoded == [limit]

        # past the hard cap (4x the limit): libzmq drops the connection; no byte reaches Python
        dealer.send(b"\xc1" * (4 * limit + 1))
        assert events.poll(30_000) and _event(events) == zmq.EVENT_DISCONNECTED
        assert server.stats.oversized == 1 and server.stats.malformed == 1 and decoded == [limit]
        assert polled == [] and not trainer.controller.stop
        dealer.disable_monitor()
        events.close(linger=0)
        dealer.close()
        ctx.term()
        report("control_oversized", limit=limit, at_limit_counted_malformed=1,
               over_limit_decoded=len(decoded) - 1, over_limit_counted_oversized=server.stats.oversized,
               past_hard_cap_dropped_by_libzmq=1)
    # leaving `training` sent a valid halt and checked it was acked and applied


def _event(monitor: zmq.Socket) -> int:
    from zmq.utils.monitor import recv_monitor_message

    return recv_monitor_message(monitor)["event"]


# ------------------------------------------------------------------ a rogue publisher

ENCODER = EventEncoder("fuzz-run", "fuzz", 0)
SENTINELS = EventEncoder("sentinel-run", "SENTINEL-0123456789abcdef", 0)


def _event_frames(topic: str, data: dict) -> list[bytes]:
    return [bytes(f) for f in ENCODER.encode(topic, 7, 7, (1, 2, 3, 4, 5), data)]


BASE_EVENTS = [
    _event_frames("batch_end", {"loss": 0.5, "lr": [0.1], "batch_size": 8}),
    _event_frames("eval_batch_end", {"outputs": torch.arange(12, dtype=torch.float32).reshape(3, 4),
                                     "targets": np.arange(3, dtype=np.int64)}),
    _event_frames("after_train_batch", {"grad_norm": torch.tensor(1.5)}),
    [encode_heartbeat("fuzz-run", "fuzz", 0, 9, {"batch_end": 7}, 0, 0.5, 3)],
    # a burst: two steps' events, the second sharing the first's ts, one with a tensor
    [bytes(f) for f in ENCODER.bursts([
        ["batch_start", 8, 3, 1.0, (1, 2, 3, 4, 5), {}],
        ["after_loss", 9, 3, 1.5, (1, 2, 3, 4, 5), {"loss": torch.tensor([0.5, 0.25])}],
        ["batch_end", 10, 7, 2.0, (1, 3, 3, 8, 5), {"loss": 0.5, "lr": [0.1]}]])[0]],
]
EVENT_FIELD = st.sampled_from([VERSION, "ev", "hb", "fuzz-run", "fuzz", 0, 7, 1.0, [1, 2, 3, 4, 5], {}]) | ANY


@st.composite
def mutated_event(draw) -> list[bytes]:
    frames = list(draw(st.sampled_from(BASE_EVENTS)))
    for _ in range(draw(st.integers(1, 3))):
        what = draw(st.sampled_from(["bytes", "bytes", "bytes", "drop", "add", "swap"]))
        i = draw(st.integers(0, len(frames) - 1))
        if what == "bytes":
            frames[i] = draw(mutate(frames[i]))
        elif what == "drop" and len(frames) > 1:
            del frames[i]
        elif what == "add":
            frames.insert(draw(st.integers(1, len(frames))), draw(st.binary(max_size=64)))
        elif what == "swap":
            frames[0], frames[i] = frames[i], frames[0]
    return frames


VALID_EVENT = [VERSION, "ev", "fuzz-run", "fuzz", 0, 7, 7, 1.0, [1, 2, 3, 4, 5], {"loss": 0.5}]
VALID_HEARTBEAT = msgpack.unpackb(BASE_EVENTS[3][0][4:])


@st.composite
def retyped(draw) -> list[bytes]:
    """A well-formed event or heartbeat body with one or two fields of another type or
    value, one field too many or too few, under an event or the heartbeat topic."""
    if draw(st.booleans()):
        body = list(VALID_EVENT)
        for _ in range(draw(st.integers(1, 2))):
            body[draw(st.integers(0, 9))] = draw(EVENT_FIELD)
        if draw(st.integers(0, 5)) == 0:
            body = body[:-1] if draw(st.booleans()) else [*body, draw(EVENT_FIELD)]
        if draw(st.integers(0, 5)) == 0:
            body[8] = draw(st.lists(EVENT_FIELD, max_size=6))
    else:
        body = dict(VALID_HEARTBEAT)
        for _ in range(draw(st.integers(1, 2))):
            key = draw(st.sampled_from(sorted(body)))
            if draw(st.booleans()):
                del body[key]
            else:
                body[key] = draw(EVENT_FIELD)
    topic = draw(st.sampled_from([b"batch_end", b"_hb", b"fit_end"]))
    return [topic + b"\0" + msgpack.packb(body)]


STRUCTURED_EVENTS = st.builds(
    lambda topic, body: [topic + b"\0" + msgpack.packb(body)],
    st.sampled_from([b"batch_end", b"_hb", b"fit_end"]),
    st.lists(EVENT_FIELD, min_size=9, max_size=11) | ANY,
)
# near misses: one field of a valid message given a value of a neighbouring type (an int
# for a float, true for an int, bin for str, bin map keys, a ts of 4 or 6), or a valid
# value at an edge (a uint64, NaN, nil for an event's d in a burst)
NEAR = {
    int: [7, -1, 2**64 - 1, 1.0, True, "7", None],
    str: ["ev", "", "x", b"ev", 1, None],
    float: [1.0, float("nan"), 7, True, "1.0", None],
    list: [[1, 2, 3, 4, 5], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5.0], [1, 2, 3, 4, True], {}],
    dict: [{}, {"x": {"y": [1, None]}}, {b"loss": 0.5}, {1: 0.5}, [], None],
}
EVENT_TYPES = [int, str, str, str, int, int, int, float, list, dict]
BURST_BODY = msgpack.unpackb(BASE_EVENTS[4][0][len(b"_burst\0"):])  # tensor descriptors kept as ext


@st.composite
def near_miss(draw) -> list[bytes]:
    what = draw(st.sampled_from(["event", "heartbeat", "burst header", "burst event"]))
    if what == "event":
        body = list(VALID_EVENT)
        i = draw(st.integers(0, 9))
        body[i] = draw(st.sampled_from(NEAR[EVENT_TYPES[i]]))
        return [b"batch_end\0" + msgpack.packb(body)]
    if what == "heartbeat":
        body = dict(VALID_HEARTBEAT)
        key = draw(st.sampled_from(sorted(body)))
        body[key] = draw(st.sampled_from(NEAR[int] + NEAR[float] + [{"x": "7"}, {"": 7}, False]))
        return [b"_hb\0" + msgpack.packb(body)]
    body = msgpack.unpackb(msgpack.packb(BURST_BODY))  # a copy
    if what == "burst header":
        i = draw(st.integers(0, 6))
        body[i] = draw(st.sampled_from(
            NEAR[[int, str, str, str, int, int, dict][i]]
            + [{"batch_start": 8, "after_loss": 3, "batch_end": 7, "_hb": 1}, {"batch_end": 7}]))
    else:
        entry = body[7][draw(st.integers(0, 2))]
        i = draw(st.integers(0, 3))
        value = draw(st.sampled_from(NEAR[[str, float, dict, list][i]] + ["fit_end", None]))
        entry[i:i + 1] = [] if i == 3 and value is None else [value]
    return [b"_burst\0" + msgpack.packb(body), *BASE_EVENTS[4][1:]]


ROGUE_INPUTS = st.one_of(
    st.lists(st.binary(max_size=200), min_size=1, max_size=4),
    mutated_event(),
    retyped(),
    near_miss(),
    STRUCTURED_EVENTS,
    NASTY.map(lambda b: [b"batch_end\0" + b]),
    st.just([b"batch_end\0" + b"\x90" * (4 << 20)]),  # past the body limit: refused by size
)


@pytest.mark.timeout(300)  # thousands of examples; ~20-60 s on a busy 2-core machine
def test_random_and_mutated_messages_from_a_rogue_publisher_are_counted_not_fatal():
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.PUB)
    rogue.sndhwm = 0
    port = rogue.bind_to_random_port("tcp://127.0.0.1")
    sub = Subscriber(f"tcp://127.0.0.1:{port}", heartbeat_timeout=60, context=ctx)
    sub._sub.subscribe(b"")  # everything the rogue sends; no join (the rogue has no state socket)
    sub._sub.connect(f"tcp://127.0.0.1:{port}")
    sent = {"n": 0}

    def send_sentinel() -> None:
        sent["n"] += 1
        n = sent["n"]
        rogue.send_multipart(SENTINELS.encode("predict_end", n, n, (0, 0, 0, 0, 0), {"n": n}))

    def sentinel() -> list[Message]:
        """Send an event the subscriber must deliver next (after anything valid that came
        before it): PUB/SUB keeps order, so once it is out, every earlier message was read.
        What the subscriber delivered before it."""
        send_sentinel()
        delivered = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            msg = sub.recv(timeout=0.5)
            if msg is not None and msg.pub == SENTINELS.pub:
                assert msg.tseq == sent["n"], "a sentinel was lost or reordered"
                return delivered
            if msg is not None:
                delivered.append(msg)
        raise AssertionError("the subscriber stopped delivering")

    # ZeroMQ's slow joiner: until the subscription reaches the PUB socket, it drops
    deadline = time.monotonic() + 30
    while (msg := sub.recv(timeout=0.2)) is None:
        assert time.monotonic() < deadline, "the subscriber never received the rogue's events"
        send_sentinel()
    while msg.tseq < sent["n"]:  # the ones still in flight
        msg = sub.recv(timeout=30)
        assert msg is not None
    first = sent["n"] + 1
    tried = {"bad": 0, "valid": 0, "valid final heartbeat, not sent": 0}

    @FUZZ
    @given(ROGUE_INPUTS)
    # an event whose kind field says "hb" was once taken for a heartbeat and crashed recv()
    @example([b"batch_end\0" + msgpack.packb([VERSION, "hb", "r", "p", 0, 1, 1, 1.0, [0, 0, 0, 0, 0], {}])])
    @example(BASE_EVENTS[-1])  # a burst as a publisher sends it: delivered, not counted
    def one(frames):
        verdict, waived = judged(wire_oracle.message, frames)
        if waived:
            tried[f"known: {waived}"] = tried.get(f"known: {waived}", 0) + 1
        if verdict.kind == "hb" and verdict.events[0].d.get("final"):
            tried["valid final heartbeat, not sent"] += 1  # it would (rightly) end the stream
            return
        # the product's decoders, as the subscriber dispatches to them, agree with the oracle
        try:
            if frames[0].startswith(b"_burst\0"):
                decoded = decode_burst(frames)
            else:
                decoded = [decode_event(frames)]
        except WireError as exc:
            assert not verdict, f"a valid {verdict.kind} message was refused: {exc}"
        else:
            assert verdict, f"a malformed message was accepted; the oracle: {verdict.why}"
            assert len(decoded) == len(verdict.events)
            for msg, event in zip(decoded, verdict.events, strict=True):
                assert same_event(msg, event), (msg, event)
        # ... and so does the subscriber: counts it, takes a heartbeat, delivers only its events
        before, beats = sub.stats.malformed, sub.stats.heartbeats
        rogue.send_multipart(frames)
        delivered = sentinel()
        assert sub.stats.malformed == before + (not verdict)
        assert sub.stats.heartbeats == beats + (verdict.kind == "hb")
        events = verdict.events if verdict.kind != "hb" else ()
        for msg in delivered:
            assert any(same_event(msg, event) for event in events), msg
        tried["valid" if verdict else "bad"] += 1

    try:
        one()
    finally:  # closed on a failure too: a context left with open sockets hangs at exit
        stats = sub.stats
        sub.close()
        rogue.close(linger=0)
        ctx.term()
    assert tried["bad"] >= EXAMPLES * 0.8 and stats.malformed == tried["bad"]
    assert stats.gaps_by_topic.get("predict_end", 0) == 0
    report("rogue_publisher_fuzz", examples=sum(n for k, n in tried.items() if not k.startswith("known")),
           **tried, counted_malformed=stats.malformed,
           sentinels_delivered=sent["n"] - first + 1)


# ------------------------------------------------------------ the publisher's state socket

STATE_INPUTS = st.one_of(
    st.binary(max_size=300),
    st.sampled_from([{"v": VERSION, "k": "state_req", "topics": ["epoch_start"]},
                     {"v": VERSION, "k": "info_req"}]).flatmap(near_request),
    STRUCTURED_V2_REQUESTS,
    st.sampled_from([encode_request("state_req", topics=["batch_end"]), encode_request("info_req")])
    .flatmap(mutate),
    STRUCTURED_REQUESTS,
    NASTY,
)


#: what the state socket's publisher has published before the fuzz, oldest first: the
#: late-join state a valid state_req gets (those of the topics it names)
STATE_HOLDS = ["fit_start", "epoch_start"]


def test_bad_requests_at_the_state_socket_are_counted_and_heartbeats_keep_flowing():
    pub = Publisher("fuzz-state", heartbeat_interval=0.1)
    pub.start()
    assert pub.publish("fit_start", (0, 0, 0, 0, 0), {"lr": 0.1})
    assert pub.publish("epoch_start", (1, 0, 0, 0, 0), {"w": np.arange(3, dtype=np.float32)})
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    dealer.connect(pub.endpoints["state"])
    tried = {"bad": 0, "valid": 0}
    try:
        @settings(FUZZ, max_examples=2000)
        @given(STATE_INPUTS)
        @example(encode_request("state_req", topics=[["x"]]))  # once killed the service thread
        @example(encode_request("state_req", topics=["epoch_start", "nothing"]))
        def one(body):
            # the reply expected is computed from the request sent, by the oracle
            verdict, waived = judged(wire_oracle.state_socket, [body])
            if waived:
                tried[f"known: {waived}"] = tried.get(f"known: {waived}", 0) + 1
            expect = {"state_req": "state", "info_req": "info"}[verdict.kind] if verdict else "error"
            assert pub.serving, "the publisher's service thread died"
            before = pub.stats.bad_requests
            dealer.send(body)
            assert dealer.poll(10_000), "the state socket stopped answering"
            reply = wire_oracle.reply(dealer.recv_multipart())
            assert reply, f"the reply breaks the documented layout: {reply.why}"
            assert reply.kind == expect
            if expect == "state":  # the latest event of each topic asked for, oldest first
                topics = verdict.body.get("topics")
                assert all(reply.entries), [entry.why for entry in reply.entries]
                assert [entry.events[0].topic for entry in reply.entries] == [
                    topic for topic in STATE_HOLDS if topics is None or topic in topics]
                assert reply.body["pub"] == pub.publisher_id and reply.body["run"] == "fuzz-state"
            elif expect == "info":
                assert reply.body["run"] == pub.run_info
            assert pub.stats.bad_requests == before + (not verdict)
            tried["valid" if verdict else "bad"] += 1

        one()
        beats = pub.stats.beats
        wait_until(lambda: pub.stats.beats >= beats + 2, 30, "heartbeats after the fuzz")
        sub = Subscriber(pub.endpoints["events"], pub.endpoints["state"], topics=["batch_end"],
                         context=ctx)
        assert sub.connect(join_timeout=30) is not None  # a late joiner still gets its state
        sub.close()
    finally:
        dealer.close()
        ctx.term()
        pub.close(linger=0.1)
    assert pub.stats.bad_requests == tried["bad"] and tried["bad"] >= 1600
    report("state_socket_fuzz", examples=tried["bad"] + tried["valid"], **tried,
           counted_bad_requests=pub.stats.bad_requests)


EVENTS_SOCKET_INPUTS = st.one_of(
    st.binary(max_size=300),
    st.tuples(st.sampled_from([b"\x00", b"\x01"]), st.binary(max_size=40)).map(b"".join),  # (un)subscriptions
    st.tuples(st.binary(min_size=1, max_size=1).filter(lambda b: b[0] > 1),
              st.sampled_from([BURST_PREFIX, b"batch_end\0", b"", b"_hb"])).map(b"".join),
)


@pytest.mark.parametrize("capped", [True, False], ids=["capped", "libzmq_proxy"])
def test_anything_a_peer_sends_into_the_events_socket_leaves_every_subscriber_served(capped):
    """Capped (as with keys), the peer is cut past 128 distinct prefixes or one longer than
    a topic's, and what it sends until it is connected again is lost to it: its foreign
    messages are counted up to what arrived, and its cuts counted too."""
    pub = Publisher("fuzz-events", heartbeat_interval=0.1, cap_subscriptions=capped)
    pub.start()
    ctx = zmq.Context()
    everything = Subscriber(pub.endpoints["events"], pub.endpoints["state"], context=ctx)  # bursts
    one_topic = Subscriber(pub.endpoints["events"], pub.endpoints["state"], topics=["batch_end"], context=ctx)
    peer = ctx.socket(zmq.XSUB)
    peer.linger = 0
    tried = {"examples": 0, "not_subscriptions": 0}
    try:
        for sub in (everything, one_topic):
            sub.connect(join_timeout=30)
        peer.connect(pub.endpoints["events"])
        step = [0]

        @settings(FUZZ, max_examples=2000)
        @given(EVENTS_SOCKET_INPUTS)
        @example(b"X" + BURST_PREFIX)  # read as "unsubscribe from bursts" before issue 24
        def one(message):
            peer.send(message)
            tried["examples"] += 1
            tried["not_subscriptions"] += not message or message[0] > 1
            step[0] += 1
            assert pub.publish("batch_end", (0, step[0], step[0], step[0], 0), {"step": step[0]})
            for sub in (everything, one_topic):  # the next event, in order, to each: none lost
                got = sub.recv(timeout=10)
                assert got is not None and got.topic == "batch_end" and got.data == {"step": step[0]}, got
            assert pub.serving, "the publisher's service thread died"

        one()
        if capped:
            time.sleep(0.5)  # what the peer sent last reaches the publisher's count
            assert 0 < pub.stats.foreign_messages <= tried["not_subscriptions"]
            assert pub.refusals().get("events_subscriptions", 0) >= 1  # random prefixes: past its cap
        else:
            wait_until(lambda: pub.stats.foreign_messages == tried["not_subscriptions"], 10,
                       "every message that is not a subscription counted")
        assert everything.stats.gaps == one_topic.stats.gaps == 0
    finally:
        peer.close()
        for sub in (everything, one_topic):
            sub.close()
        ctx.term()
        pub.close(linger=0.1)
    report("events_socket_fuzz", **tried, counted_foreign=pub.stats.foreign_messages)


# ------------------------------------------- the oracle, and the rules the product breaks

def _framed(topic: bytes, body) -> bytes:
    return topic + b"\0" + msgpack.packb(body)


def test_the_oracle_takes_what_the_product_sends_and_refuses_the_nasties():
    """Not circular: the oracle was written from docs/protocol.md, so this checks the encoders."""
    for frames in BASE_EVENTS:
        assert wire_oracle.message(frames), frames
    assert wire_oracle.message([_framed(b"batch_end", VALID_EVENT)])
    for body in (encode_request("state_req", topics=["batch_end"]), encode_request("info_req"),
                 encode_request("state_req", topics=None)):
        assert wire_oracle.state_socket([body]) and not wire_oracle.control([body])
    halt = encode_request("ctl", client="c", req=1, op="halt", args={"reason": "r"}, t=1.0)
    assert wire_oracle.control([halt]) and not wire_oracle.state_socket([halt])
    for nasty in NASTIES:
        assert not wire_oracle.message([b"batch_end\0" + nasty]), nasty
        assert not wire_oracle.control([nasty]) and not wire_oracle.state_socket([nasty]), nasty
