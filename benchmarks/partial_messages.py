"""What raw connections holding partly sent messages cost a real trainer (issue 44, 3b).

A real Trainer (tests/programs/slow_trainer.py: a linear model, batches paced by its data
loader) runs in a child process. This process opens `--connections` raw TCP connections
to each of its public sockets (control, state, events), completes ZMTP 3.0's NULL
handshake on each (as a DEALER, or a SUB for the events socket) and then sends all but
the last byte of the largest message that socket admits (its ZMQ_MAXMSGSIZE), so libzmq
buffers each one while waiting for the rest. Then it reads the trainer's RSS.

  connections          per socket (three sockets)
  rss_growth_mib       the trainer's peak RSS with every connection open, over its RSS before
  per_connection_kib   that growth over all the connections
  batches_meanwhile    batches the trainer finished while the connections were held (it trains on)
  cut                  connections the trainer shut down at once, by socket (from its heartbeats)

Prints one JSON object per `--connections` value given. Usage:
    python benchmarks/partial_messages.py --connections 16 40 200
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from helpers.raw_zmtp import hold_partial  # noqa: E402
from proc_memory import rss_mib  # noqa: E402

from offloop.bus import read_run_info  # noqa: E402
from offloop.bus.wire import MAX_SUBSCRIPTION_BYTES, request_socket_cap  # noqa: E402

#: the largest message each socket admits (the partial one held is one byte short of it)
CAPS = {"control": request_socket_cap(), "state": request_socket_cap(), "events": MAX_SUBSCRIPTION_BYTES}
PEER_TYPE = {"control": b"DEALER", "state": b"DEALER", "events": b"SUB"}


def measure(count: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT.parent), str(ROOT / "tests"),
                                                            os.environ.get("PYTHONPATH", "")])}
        child = subprocess.Popen([sys.executable, str(ROOT / "tests/programs/slow_trainer.py"),
                                  tmp, "100000", "0.01"], stdout=subprocess.PIPE, env=env, text=True,
                                 cwd=tmp)
        conns: list = []
        try:
            pid = json.loads(child.stdout.readline())["pid"]
            deadline = time.monotonic() + 60
            while not (Path(tmp) / "run.json").exists():
                if time.monotonic() > deadline or child.poll() is not None:
                    raise RuntimeError("the trainer wrote no run.json")
                time.sleep(0.05)
            endpoints = read_run_info(tmp).endpoints
            time.sleep(2)  # past start-up's allocations
            before = rss_mib(pid)
            steps_before, _ = _steps(tmp)
            for name in ("control", "state", "events"):
                conns += [hold_partial(endpoints[name], PEER_TYPE[name], CAPS[name])
                          for _ in range(count)]
            time.sleep(3)  # libzmq reads what was sent
            peak = rss_mib(pid, "VmHWM")
            for conn in conns:  # the probe below needs a place
                conn.close()
            steps, refused = _steps(tmp)
            steps -= steps_before
        finally:
            for conn in conns:
                conn.close()
            child.kill()
            child.wait(timeout=10)
    growth = peak - before
    return {"connections": count, "sockets": 3, "rss_before_mib": round(before, 1),
            "rss_growth_mib": round(growth, 1),
            "per_connection_kib": round(growth * 1024 / (3 * count), 1),
            "batches_meanwhile": steps,
            "cut": {k: v for k, v in refused.items() if k.endswith("_connections")}}


def _steps(run_dir: str) -> tuple[int, dict[str, int]]:
    """The trainer's latest step, from its state socket (as a real client asks it), and
    what its sockets refused so far, from its next heartbeat."""
    from offloop.bus import Subscriber

    info = read_run_info(run_dir)
    with Subscriber(info.endpoints["events"], info.endpoints["state"]) as sub:
        state = sub.connect(join_timeout=10)
        beats = sub.stats.heartbeats
        deadline = time.monotonic() + 10
        while sub.stats.heartbeats == beats and time.monotonic() < deadline:
            sub.recv(timeout=0.1)
        refused = dict(sub.publisher_refused)
    return (max((entry.ts[1] for entry in state.entries), default=0) if state else 0), refused


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, nargs="+", default=[16, 40, 200])
    args = parser.parse_args()
    for count in args.connections:
        if count < 1:
            parser.error(f"--connections must be at least 1, got {count}")
    for count in args.connections:
        print(json.dumps(measure(count)), flush=True)


if __name__ == "__main__":
    main()
