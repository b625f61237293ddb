"""Bus benchmark: the publishing thread's cost per event against raw pyzmq floors.

Prints one JSON object per measurement and, last, one summary object. Every figure is
measured in this run, so the ratios hold on whatever machine runs it. Every Publisher and
Subscriber runs with the product's queue bounds (queue_size and subscriber_hwm 10 000
messages, the Subscriber's rcvhwm 10 000) except where a key says `unbounded`; the floors'
raw sockets are unbounded, so a floor never gets cheaper by dropping.

Floors (a raw PUB socket into one raw SUB process; events built beforehand, so a floor
packs and sends and does nothing else):
  floor_us            one event: msgpack.packb(envelope dict) + send, per call (median)
  floor_send_only_us  one send of bytes packed beforehand, per call
  floor_batched_us    256 events packed as a burst packs them (one msgpack.packb of the
                      burst's array: the first event with its ts, the others without,
                      then one send), per event; timed window by window, interleaved
                      with the held case below
  floor_batched_ormsgpack_us  the same with ormsgpack, the packer the product uses:
                      how much of the batched floor is msgpack's packer (not a target)

(a) scalar snapshot event into one subscriber process. Every case but
    scalar_payload_built_us publishes the same payload dict, built once, as the floors
    pack it: the caller's cost of building an event is in no other figure.
  scalar_us           held, as the trainer publishes when its steps are fast: bursts of
                      256 events (the publisher's cap), into a subscriber of everything;
                      the median over windows of 256 publish() calls, each window's
                      burst (numbering, packing, send) included, per event
  ratio_batched       scalar_us / floor_batched_us: the like-for-like ratio for held
                      publishing (target <= 2.0, `ratio_batched_met`)
  scalar_payload_built_us  scalar_us with the payload dict built at every call, as the
                      trainer builds it (and as this script's scalar_us did before
                      floor_batched_us): the caller's share, which no floor pays
  scalar_ratio        scalar_us / floor_us: held publishing against the unbatched floor.
                      Not like for like (one pack and send per 256 events against one
                      per event); kept so earlier runs compare
  scalar_step_burst_us  held, released (one burst) after every step of 13 events
  scalar_single_us    not held: one message per event into a subscriber of its topic,
                      per call; scalar_single_ratio = scalar_single_us / floor_us is the
                      like-for-like ratio for unbatched publishing
(b) unsubscribed_us: an event nobody subscribes to (target <= 0.3 us)
(c) tensor_1mib_us: an event carrying a 1 MiB tensor (its bytes sent without a copy)
(d) sustained, into one subscriber process that decodes every event and counts loss:
  events_per_s        held as the trainer holds them (bursts at the Trainer's default
                      burst_interval) into a subscriber of everything: events received
                      per second (target >= 300 000 with no loss, `events_per_s_met`)
  events_per_s_single one message per event into a subscriber of the topic
  events_per_s_unbounded  held, with every queue unbounded: the subscriber's decode rate
                      when nothing can be dropped; says nothing about the product's loss
  gaps*, duplicates*, publisher_drops*  loss of each sustained case: gaps are events the
                      subscriber counted lost (they include what the publisher dropped);
                      publisher_drops counts messages its queue refused (one burst
                      message holds up to 256 events); duplicates must be 0

What these do not show: only the held case and the batched floors are interleaved;
floor_us, scalar_single_us and the rest run one after another, so a slow spell can move
their ratios. The per-call medians leave out the occasional send that wakes the proxy (the
window medians of the held case and the batched floors include theirs). No figure
includes the trainer's own work or the other core's load from the subscriber process.
Zero gaps with bursts says that 10 000 queued messages of up to 256 events each sufficed
for this subscriber here, not that a slower one keeps up.

Run: python benchmarks/bus.py [--calls N] [--events N] [--single-events N]
"""

from __future__ import annotations

import argparse
import inspect
import json
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable

import msgpack
import numpy as np
import ormsgpack
import torch
import zmq

from offloop.bus import Publisher, Subscriber
from offloop.bus.publisher import HOLD_AT_MOST  # held events a publisher sends at once
from offloop.bus.wire import BURST_PREFIX, VERSION
from offloop.trainer import Trainer

STEP_EVENTS = 13  # events the trainer publishes per plain training step
BURST_INTERVAL = inspect.signature(Trainer).parameters["burst_interval"].default  # the Trainer's default
RATIO_BATCHED_TARGET = 2.0
UNSUBSCRIBED_TARGET_US = 0.3
EVENTS_PER_S_TARGET = 300_000
PAYLOAD = {"loss": 0.6931, "lr": [0.001], "batch_size": 32}  # a scalar snapshot's fields
TS = (0, 100, 100, 3200, 0)


def timed(fn, n: int) -> tuple[float, float]:
    """Median and p99 in microseconds of n calls, each timed on its own."""
    clock = time.perf_counter_ns
    samples = []
    for _ in range(n):
        start = clock()
        fn()
        samples.append(clock() - start)
    overhead = statistics.median(_clock_overhead(clock) for _ in range(2001))
    samples.sort()
    return (samples[n // 2] - overhead) / 1000, (samples[int(n * 0.99)] - overhead) / 1000


def _clock_overhead(clock) -> int:
    start = clock()
    return clock() - start


def interleaved(cases: dict[str, Callable[[], None]], rounds: int) -> dict[str, tuple[float, float]]:
    """Median and p99 in microseconds of each case's calls, the cases taking turns call
    by call (the first of each round rotating): a slow spell of a shared machine then
    falls on every case alike, not on whichever happened to run during it."""
    clock = time.perf_counter_ns
    names = list(cases)
    samples: dict[str, list[int]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn = cases[name]
            start = clock()
            fn()
            samples[name].append(clock() - start)
    out = {}
    for name, values in samples.items():
        values.sort()
        out[name] = values[len(values) // 2] / 1000, values[int(len(values) * 0.99)] / 1000
    return out


def _reader(events: str, state: str | None, topics, ready, out, expect: int, unbounded: bool) -> None:
    """A subscriber process: joins, then drains as fast as it can."""
    if state is None:  # raw floor stream: a plain SUB socket
        ctx = zmq.Context()
        sock = ctx.socket(zmq.SUB)
        sock.rcvhwm = 0
        sock.subscribe(b"")
        sock.connect(events)
        ready.put(True)
        sock.rcvtimeo = 2000
        n = 0
        try:
            while True:
                sock.recv()
                n += 1
        except zmq.Again:
            out.put({"received": n})
        return
    bounds = {"rcvhwm": 0} if unbounded else {}  # otherwise the Subscriber's own default
    sub = Subscriber(events, state, topics=topics, heartbeat_timeout=30, **bounds)
    sub.connect(join_timeout=10)
    ready.put(True)
    first = last = None
    while sub.stats.received + sub.stats.gaps < expect:
        msg = sub.recv(timeout=5)
        if msg is None:
            break
        if msg.from_state:
            continue
        last = time.perf_counter()
        first = first or last
    out.put({"received": sub.stats.received, "gaps": sub.stats.gaps,
             "duplicates": sub.stats.duplicates, "malformed": sub.stats.malformed,
             "seconds": (last or 0) - (first or 0)})
    sub.close()


def start_reader(events, state, topics, expect=0, unbounded=False):
    ctx = mp.get_context("spawn")
    ready, out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_reader, args=(events, state, topics, ready, out, expect, unbounded))
    proc.start()
    ready.get(timeout=30)
    return proc, out


def batched_floor(raw: zmq.Socket, pack: Callable[[object], bytes]) -> Callable[[], None]:
    """One window of the batched floor: HOLD_AT_MOST events laid out as a burst lays them
    out ([topic, t, d, ts] for the first, [topic, t, d] after it: they share one ts),
    packed in one call with `pack` and sent as one message."""
    t = time.time()
    entries = [("batch_end", t, PAYLOAD, TS)] + [("batch_end", t, PAYLOAD)] * (HOLD_AT_MOST - 1)
    body = [VERSION, "bu", "bench", "0123456789ab", 0, 1, {"batch_end": 1}, entries]

    def window() -> None:
        raw.send(BURST_PREFIX + pack(body), zmq.NOBLOCK)

    return window


def held_window(pub: Publisher, build: bool = False) -> Callable[[], None]:
    """One window of held publishing: HOLD_AT_MOST publish() calls, the last of which
    sends the burst (the publisher holds with an interval never due, so only its cap of
    256 releases). The same ts object every call, as a Timestamp gives; the payload the
    floors pack, or (`build`) a new dict every call, as the trainer makes one."""
    def window() -> None:
        for _ in range(HOLD_AT_MOST):
            pub.publish("batch_end", TS, PAYLOAD)

    def window_built() -> None:
        for _ in range(HOLD_AT_MOST):
            pub.publish("batch_end", TS, {"loss": 0.6931, "lr": [0.001], "batch_size": 32})

    return window_built if build else window


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=100_000,
                        help="timed calls per case (the windowed cases: calls / 256 windows)")
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--single-events", type=int, default=300_000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    windows = max(1, args.calls // HOLD_AT_MOST)

    # floors: a raw PUB socket sending what our envelope holds, as a msgpack-encoded dict
    ctx = zmq.Context()
    raw = ctx.socket(zmq.PUB)
    raw.sndhwm = 0
    port = raw.bind_to_random_port("tcp://127.0.0.1")
    floor_reader, _ = start_reader(f"tcp://127.0.0.1:{port}", None, None)
    time.sleep(0.2)
    envelope = {"v": 1, "k": "ev", "run": "bench", "pub": "0123456789ab", "rank": 0, "seq": 1,
                "tseq": 1, "t": time.time(), "ts": list(TS), "d": PAYLOAD}
    floor_med, floor_p99 = timed(lambda: raw.send(msgpack.packb(envelope), zmq.NOBLOCK), args.calls)
    packed = msgpack.packb(envelope)
    send_med, _ = timed(lambda: raw.send(packed, zmq.NOBLOCK), args.calls)
    print(json.dumps({"case": "floor", "median_us": floor_med, "p99_us": floor_p99,
                      "send_only_median_us": send_med}), flush=True)

    # (a) held, bursts of 256 events (the publisher's cap), window by window, interleaved
    # with the batched floors; then, apart, one burst after every step
    pub = Publisher("bench-held", heartbeat_interval=0.5)
    endpoints = pub.start()
    reader, _ = start_reader(endpoints["events"], endpoints["state"], None, expect=10**12)
    pub.hold(60.0)  # never due by time: each 256th publish sends the burst
    cases = {"held": held_window(pub), "held_payload_built": held_window(pub, build=True),
             "floor_batched": batched_floor(raw, msgpack.packb),
             "floor_batched_ormsgpack": batched_floor(raw, ormsgpack.packb)}
    for window in cases.values():  # warm up: first sends, first packs
        window()
    per_window = interleaved(cases, windows)
    scalar_med, scalar_p99 = (v / HOLD_AT_MOST for v in per_window["held"])
    built_med, _ = (v / HOLD_AT_MOST for v in per_window["held_payload_built"])
    batched_med, batched_p99 = (v / HOLD_AT_MOST for v in per_window["floor_batched"])
    orm_med, _ = (v / HOLD_AT_MOST for v in per_window["floor_batched_ormsgpack"])
    floor_reader.join(timeout=30)  # it stops 2 s after the last floor message
    raw.close(linger=0)
    print(json.dumps({"case": "floor_batched", "burst_events": HOLD_AT_MOST,
                      "median_us": batched_med, "p99_us": batched_p99,
                      "ormsgpack_median_us": orm_med}), flush=True)
    pub.hold(0.0)

    def step_burst() -> None:
        for _ in range(STEP_EVENTS):
            pub.publish("batch_end", TS, PAYLOAD)
        pub.release()

    step_med, step_p99 = timed(step_burst, max(1, args.calls // STEP_EVENTS))
    print(json.dumps({"case": "scalar_held", "burst_events": HOLD_AT_MOST,
                      "median_us": scalar_med, "p99_us": scalar_p99,
                      "payload_built_median_us": built_med,
                      "ratio_batched": scalar_med / batched_med,
                      "ratio": scalar_med / floor_med, "ratio_send_only": scalar_med / send_med,
                      "events_per_step": STEP_EVENTS,
                      "burst_every_step_median_us": step_med / STEP_EVENTS,
                      "burst_every_step_p99_us": step_p99 / STEP_EVENTS,
                      "publisher_drops": pub.stats.drops}), flush=True)
    pub.close(linger=0.1)
    reader.kill()

    pub = Publisher("bench", heartbeat_interval=0.5)
    endpoints = pub.start()
    reader, _ = start_reader(endpoints["events"], endpoints["state"], ["batch_end", "eval_batch_end"],
                             expect=10**12)
    single_med, single_p99 = timed(lambda: pub.publish("batch_end", TS, PAYLOAD), args.calls)
    print(json.dumps({"case": "scalar_single", "median_us": single_med, "p99_us": single_p99,
                      "ratio": single_med / floor_med, "publisher_drops": pub.stats.drops}), flush=True)

    unsub_med, unsub_p99 = timed(lambda: pub.publish("after_forward", TS, None), args.calls)
    print(json.dumps({"case": "unsubscribed", "median_us": unsub_med, "p99_us": unsub_p99}),
          flush=True)

    tensor = torch.randn(512, 512)  # 1 MiB of float32
    frames = pub.outbox.encoder.encode("eval_batch_end", 0, 0, TS, {"outputs": tensor})
    zero_copy = _address(frames[1]) == tensor.data_ptr()
    tensor_med, tensor_p99 = timed(
        lambda: pub.publish("eval_batch_end", TS, {"outputs": tensor}), min(args.calls, 2000))
    print(json.dumps({"case": "tensor_1mib", "median_us": tensor_med, "p99_us": tensor_p99,
                      "zero_copy": zero_copy}), flush=True)
    pub.close(linger=0.2)
    reader.kill()

    held = sustained(args.events, held=True)
    print(json.dumps({"case": "sustained_held", **held}), flush=True)
    single = sustained(args.single_events, held=False)
    print(json.dumps({"case": "sustained_single", **single}), flush=True)
    unbounded = sustained(args.events, held=True, unbounded=True)
    print(json.dumps({"case": "sustained_held_unbounded", **unbounded}), flush=True)

    ratio_batched = scalar_med / batched_med
    print(json.dumps({
        "scalar_us": round(scalar_med, 3), "scalar_p99_us": round(scalar_p99, 3),
        "scalar_payload_built_us": round(built_med, 3),
        "floor_batched_us": round(batched_med, 3), "floor_batched_p99_us": round(batched_p99, 3),
        "floor_batched_ormsgpack_us": round(orm_med, 3),
        "ratio_batched": round(ratio_batched, 3), "ratio_batched_target": RATIO_BATCHED_TARGET,
        "ratio_batched_met": ratio_batched <= RATIO_BATCHED_TARGET,
        "floor_us": round(floor_med, 3), "floor_p99_us": round(floor_p99, 3),
        "floor_send_only_us": round(send_med, 3),
        "scalar_ratio": round(scalar_med / floor_med, 3),
        "scalar_ratio_send_only": round(scalar_med / send_med, 3),
        "scalar_step_burst_us": round(step_med / STEP_EVENTS, 3),
        "scalar_step_burst_p99_us": round(step_p99 / STEP_EVENTS, 3),
        "scalar_single_us": round(single_med, 3), "scalar_single_p99_us": round(single_p99, 3),
        "scalar_single_ratio": round(single_med / floor_med, 3),
        "unsubscribed_us": round(unsub_med, 3), "unsubscribed_target_us": UNSUBSCRIBED_TARGET_US,
        "unsubscribed_met": unsub_med <= UNSUBSCRIBED_TARGET_US,
        "tensor_1mib_us": round(tensor_med, 3), "tensor_zero_copy": zero_copy,
        "events_per_s": round(held["events_per_s"]), "events_per_s_target": EVENTS_PER_S_TARGET,
        "events_per_s_met": held["events_per_s"] >= EVENTS_PER_S_TARGET and _lossless(held),
        "gaps": held["gaps"], "duplicates": held["duplicates"],
        "publisher_drops": held["publisher_drops"], "events": args.events,
        "events_per_s_single": round(single["events_per_s"]), "gaps_single": single["gaps"],
        "duplicates_single": single["duplicates"],
        "publisher_drops_single": single["publisher_drops"], "events_single": args.single_events,
        "events_per_s_unbounded": round(unbounded["events_per_s"]),
        "gaps_unbounded": unbounded["gaps"],
    }))


def sustained(n: int, held: bool, unbounded: bool = False) -> dict:
    """Publish n scalar events flat out into one subscriber process that decodes them all:
    held as the trainer holds them (steps of 13 events, bursts at the Trainer's default
    burst_interval) into a subscriber of everything, or one message each into a subscriber
    of the topic. The product's queue bounds unless `unbounded`, where nothing can be dropped."""
    bounds = {"queue_size": n + 1, "subscriber_hwm": 0} if unbounded else {}
    pub = Publisher("bench-sustained", heartbeat_interval=0.2, **bounds)
    endpoints = pub.start()
    reader, out = start_reader(endpoints["events"], endpoints["state"], None if held else ["batch_end"],
                               expect=n, unbounded=unbounded)
    ts = (0, 1, 1, 32, 0)
    start = time.perf_counter()
    if held:
        pub.hold(BURST_INTERVAL)
        for i in range(1, n + 1):
            pub.publish("batch_end", ts, {"loss": 0.5})
            if not i % STEP_EVENTS:
                pub.release_due()
        pub.release(stop_holding=True)
    else:
        for _ in range(n):
            pub.publish("batch_end", ts, {"loss": 0.5})
    sent_s = time.perf_counter() - start
    result = out.get(timeout=600)
    reader.join(timeout=30)
    pub.close(linger=0.2)
    # The subscriber's own receive span: the rate it took them in at, end to end; events
    # it lost are not counted as taken in.
    seconds = max(result["seconds"], sent_s)
    return {"events": n, "received": result["received"], "gaps": result["gaps"],
            "duplicates": result["duplicates"], "malformed": result["malformed"],
            "publisher_drops": pub.stats.drops, "publish_s": round(sent_s, 3),
            "events_per_s": result["received"] / seconds}


def _lossless(result: dict) -> bool:
    """Every event received once: none lost, dropped, duplicated or malformed."""
    return result["received"] == result["events"] and not (
        result["gaps"] or result["duplicates"] or result["malformed"] or result["publisher_drops"])


def _address(view: memoryview) -> int:
    """Where a frame's bytes live: equal to the tensor's data_ptr() means no copy was made."""
    return np.frombuffer(view, dtype=np.uint8).ctypes.data


if __name__ == "__main__":
    main()
