"""What a flood of subscription prefixes costs a publisher's memory (issue 44, attack 3c).

A child process runs a publisher (tests/programs/streaming_publisher.py: a batch_end a
millisecond); beside one subscriber of `batch_end`, one SUB socket (sndhwm 0, so every
prefix leaves) sends `--count` distinct prefixes of `--length` bytes, and sends them all
again whenever libzmq reconnects it. After `--hold` seconds the publisher's peak RSS
(`VmHWM`) is read; then the flooding socket leaves and its RSS is read again. With
`--capped` the publisher caps subscriptions by connection, as a run with keys does
(bus/subscription_cap.py); without it, as a run without keys.

  peak_growth_mib    the publisher's peak RSS over its RSS before the flood (target < 64)
  after_left_mib     its RSS 3 s after the flooding socket closed, over the same
  received           batch_end events the other subscriber got meanwhile (a cut would show)

Prints one JSON object. Usage:
    python benchmarks/subscription_flood.py --count 1500 --length 4000 [--capped]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import zmq
from proc_memory import rss_mib

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=1500)
    parser.add_argument("--length", type=int, default=4000)
    parser.add_argument("--hold", type=float, default=3.0)
    parser.add_argument("--capped", action="store_true", help="subscriptions capped, as with keys")
    args = parser.parse_args()
    if args.length < 7 or args.count < 1:
        parser.error("--length must be at least 7 bytes and --count at least 1")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, str(ROOT / "tests/programs/streaming_publisher.py"),
                              str(args.hold + 30), *(["capped"] if args.capped else [])],
                             stdout=subprocess.PIPE, env=env, text=True)
    ctx = zmq.Context()
    try:
        endpoints = json.loads(child.stdout.readline())
        child.stdout.readline()  # {"published": 100}
        before = rss_mib(child.pid, "VmRSS")
        good = ctx.socket(zmq.SUB)
        good.connect(endpoints["events"])
        good.subscribe(b"batch_end\0")
        time.sleep(0.5)
        flood = ctx.socket(zmq.SUB)
        flood.sndhwm, flood.linger = 0, 0
        flood.connect(endpoints["events"])
        for i in range(args.count):
            flood.subscribe(b"%06d" % i + b"x" * (args.length - 6))
        received, deadline = 0, time.monotonic() + args.hold
        while time.monotonic() < deadline:
            if good.poll(50):
                good.recv()
                received += 1
        peak = rss_mib(child.pid, "VmHWM")
        flood.close()
        time.sleep(3)
        after = rss_mib(child.pid, "VmRSS")
        good.close(linger=0)
    finally:
        child.kill()
        child.wait(timeout=10)
        ctx.term()
    print(json.dumps({"count": args.count, "length": args.length, "capped": args.capped,
                      "rss_before_mib": round(before, 1),
                      "peak_growth_mib": round(peak - before, 1),
                      "after_left_mib": round(after - before, 1), "received": received}))


if __name__ == "__main__":
    main()
