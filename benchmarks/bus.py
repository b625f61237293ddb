"""Bus benchmark: the publishing thread's cost per event against a raw pyzmq floor.

Prints one JSON object per measurement and, last, one summary object. Every figure
is measured in this run, so the ratios hold on whatever machine runs it:

  (a) scalar snapshot event, one subscriber process   vs  floor: msgpack.packb + PUB send
      - as the trainer publishes when its steps are fast: held, and sent in bursts of
        256 events (what 5 ms of steps under 250 us amount to, capped by the publisher's
        256), into a subscriber of everything; the median over windows of 256 events,
        each burst included                                         -> scalar_us
      - the same, released (one burst) after every step            -> scalar_step_burst_us
      - on its own: not held, one message per event, into a subscriber of its topic
                                                                   -> scalar_single_us
  (b) an event nobody subscribes to
  (c) an event carrying a 1 MiB tensor (its bytes are sent without a Python-side copy)
  (d) sustained events/s into one subscriber process that decodes every event and
      counts gaps: held as the trainer holds them (bursts every 5 ms) into a subscriber
      of everything -> events_per_s; and one message per event into a subscriber of
      the topic -> events_per_s_single

Run: python benchmarks/bus.py [--calls N] [--events N] [--single-events N]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time

import msgpack
import numpy as np
import torch
import zmq

from offloop.bus import Publisher, Subscriber
from offloop.bus.publisher import HOLD_AT_MOST  # held events a publisher sends at once

STEP_EVENTS = 13  # events the trainer publishes per plain training step
BURST_INTERVAL = 0.005  # the Trainer's default burst_interval


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


def _reader(events: str, state: str | None, topics, ready, out, expect: int) -> None:
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
    sub = Subscriber(events, state, topics=topics, rcvhwm=0, heartbeat_timeout=30)
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
             "seconds": (last or 0) - (first or 0)})
    sub.close()


def start_reader(events, state, topics, expect=0):
    ctx = mp.get_context("spawn")
    ready, out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_reader, args=(events, state, topics, ready, out, expect))
    proc.start()
    ready.get(timeout=30)
    return proc, out


def scalar_payload(i: int) -> dict:
    return {"loss": 0.6931, "lr": [0.001], "batch_size": 32}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=100_000)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--single-events", type=int, default=300_000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ts = (0, 100, 100, 3200, 0)

    # floor: a raw PUB socket sending the same msgpack-encoded dict our envelope holds
    ctx = zmq.Context()
    raw = ctx.socket(zmq.PUB)
    raw.sndhwm = 0
    port = raw.bind_to_random_port("tcp://127.0.0.1")
    reader, out = start_reader(f"tcp://127.0.0.1:{port}", None, None)
    time.sleep(0.2)
    envelope = {"v": 1, "k": "ev", "run": "bench", "pub": "0123456789ab", "rank": 0, "seq": 1,
                "tseq": 1, "t": time.time(), "ts": list(ts), "d": scalar_payload(0)}
    floor_med, floor_p99 = timed(lambda: raw.send(msgpack.packb(envelope), zmq.NOBLOCK), args.calls)
    packed = msgpack.packb(envelope)
    send_med, _ = timed(lambda: raw.send(packed, zmq.NOBLOCK), args.calls)
    reader.join(timeout=30)
    raw.close(linger=0)
    print(json.dumps({"case": "floor", "median_us": floor_med, "p99_us": floor_p99,
                      "send_only_median_us": send_med}), flush=True)

    # (a) as the trainer publishes: held, bursts of 256 events (the publisher's cap) timed
    # window by window, each window one burst; and, apart, one burst after every step
    pub = Publisher("bench-held", heartbeat_interval=0.5, queue_size=1_000_000, subscriber_hwm=0)
    endpoints = pub.start()
    reader, out = start_reader(endpoints["events"], endpoints["state"], None, expect=10**12)
    steps = max(1, args.calls // STEP_EVENTS)
    pub.hold(60.0)  # never due by time: each 256th publish sends the burst

    def window() -> None:
        for _ in range(HOLD_AT_MOST):
            pub.publish("batch_end", ts, scalar_payload(0))

    window()
    window_med, window_p99 = timed(window, max(1, args.calls // HOLD_AT_MOST))
    scalar_med, scalar_p99 = window_med / HOLD_AT_MOST, window_p99 / HOLD_AT_MOST
    pub.hold(0.0)

    def step_burst() -> None:
        for _ in range(STEP_EVENTS):
            pub.publish("batch_end", ts, scalar_payload(0))
        pub.release()

    step_med, step_p99 = timed(step_burst, steps)
    print(json.dumps({"case": "scalar_held", "burst_events": HOLD_AT_MOST,
                      "median_us": scalar_med, "p99_us": scalar_p99,
                      "ratio": scalar_med / floor_med, "ratio_send_only": scalar_med / send_med,
                      "events_per_step": STEP_EVENTS,
                      "burst_every_step_median_us": step_med / STEP_EVENTS,
                      "burst_every_step_p99_us": step_p99 / STEP_EVENTS}), flush=True)
    pub.close(linger=0.1)
    reader.kill()

    pub = Publisher("bench", heartbeat_interval=0.5, queue_size=1_000_000,
                    subscriber_hwm=0)
    endpoints = pub.start()
    reader, out = start_reader(endpoints["events"], endpoints["state"], ["batch_end", "eval_batch_end"],
                               expect=10**12)
    single_med, single_p99 = timed(lambda: pub.publish("batch_end", ts, scalar_payload(0)), args.calls)
    print(json.dumps({"case": "scalar_single", "median_us": single_med, "p99_us": single_p99,
                      "ratio": single_med / floor_med}), flush=True)

    unsub_med, unsub_p99 = timed(lambda: pub.publish("after_forward", ts, None), args.calls)
    print(json.dumps({"case": "unsubscribed", "median_us": unsub_med, "p99_us": unsub_p99}),
          flush=True)

    tensor = torch.randn(512, 512)  # 1 MiB of float32
    frames = pub._encoder.encode("eval_batch_end", 0, 0, ts, {"outputs": tensor})
    zero_copy = _address(frames[1]) == tensor.data_ptr()
    tensor_med, tensor_p99 = timed(
        lambda: pub.publish("eval_batch_end", ts, {"outputs": tensor}), min(args.calls, 2000))
    print(json.dumps({"case": "tensor_1mib", "median_us": tensor_med, "p99_us": tensor_p99,
                      "zero_copy": zero_copy}), flush=True)
    pub.close(linger=0.2)
    reader.kill()

    throughput = sustained(args.events, held=True)
    print(json.dumps({"case": "sustained_held", **throughput}), flush=True)
    single = sustained(args.single_events, held=False)
    print(json.dumps({"case": "sustained_single", **single}), flush=True)

    print(json.dumps({
        "scalar_us": round(scalar_med, 3), "scalar_p99_us": round(scalar_p99, 3),
        "floor_us": round(floor_med, 3), "floor_p99_us": round(floor_p99, 3),
        "floor_send_only_us": round(send_med, 3),
        "scalar_ratio": round(scalar_med / floor_med, 3),
        "scalar_ratio_send_only": round(scalar_med / send_med, 3),
        "scalar_step_burst_us": round(step_med / STEP_EVENTS, 3),
        "scalar_step_burst_p99_us": round(step_p99 / STEP_EVENTS, 3),
        "scalar_single_us": round(single_med, 3), "scalar_single_p99_us": round(single_p99, 3),
        "scalar_single_ratio": round(single_med / floor_med, 3),
        "unsubscribed_us": round(unsub_med, 3),
        "tensor_1mib_us": round(tensor_med, 3), "tensor_zero_copy": zero_copy,
        "events_per_s": round(throughput["events_per_s"]), "gaps": throughput["gaps"],
        "events": args.events,
        "events_per_s_single": round(single["events_per_s"]), "gaps_single": single["gaps"],
        "events_single": args.single_events,
    }))


def sustained(n: int, held: bool) -> dict:
    """Publish n scalar events flat out into one subscriber process that decodes them all:
    held as the trainer holds them (steps of 13 events, a burst every 5 ms) into a
    subscriber of everything, or one message each into a subscriber of the topic."""
    pub = Publisher("bench-sustained", heartbeat_interval=0.2, queue_size=n + 1, subscriber_hwm=0)
    endpoints = pub.start()
    reader, out = start_reader(endpoints["events"], endpoints["state"], None if held else ["batch_end"],
                               expect=n)
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
    # The subscriber's own receive span: the rate it took them in at, end to end.
    seconds = max(result["seconds"], sent_s)
    return {"events": n, "received": result["received"], "gaps": result["gaps"],
            "publisher_drops": pub.drops, "publish_s": round(sent_s, 3),
            "events_per_s": n / seconds}


def _address(view: memoryview) -> int:
    """Where a frame's bytes live: equal to the tensor's data_ptr() means no copy was made."""
    return np.frombuffer(view, dtype=np.uint8).ctypes.data


if __name__ == "__main__":
    main()
