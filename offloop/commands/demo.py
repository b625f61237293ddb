"""`offloop demo`: a publisher and a subscriber in another process, end to end.

Until the trainer lands this exercises the bus alone: a simulated run publishes
Composer events, a monitor process joins late, receives them and reports its counts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-dir", default=None, help="where run.json goes (default: runs/demo-<id>)")
    parser.add_argument("--batches", type=int, default=2000, help="batches to simulate")


def run(args: argparse.Namespace) -> int:
    from bus import Event, Publisher, RunInfo, mark_finished, write_run_info

    run_id = uuid.uuid4().hex[:8]
    run_dir = Path(args.run_dir or f"runs/demo-{run_id}")
    pub = Publisher(run_id, heartbeat_interval=0.2)
    endpoints = pub.start()
    pub.set_config({"model": "simulated", "batches": args.batches, "lr": 0.1})
    write_run_info(run_dir, RunInfo(run_id, run_dir.name, os.getpid(), time.time(), endpoints))
    monitor = subprocess.Popen([sys.executable, "-m", "offloop.commands.demo", endpoints["events"],
                                endpoints["state"]], stdout=subprocess.PIPE, text=True)
    assert monitor.stdout is not None
    print(f"run {run_id}: events {endpoints['events']}, state {endpoints['state']}")
    pub.publish(Event.INIT, (0, 0, 0, 0, 0), {})
    pub.publish(Event.FIT_START, (0, 0, 0, 0, 0), {})
    print("monitor:", monitor.stdout.readline().strip())  # joined: it is listening
    for batch in range(1, args.batches + 1):
        ts = (0, batch, batch, batch * 32, 0)
        pub.publish(Event.BATCH_START, ts, {})
        pub.publish(Event.BATCH_END, ts, {"loss": math.exp(-batch / 500), "lr": [0.1]})
    pub.publish(Event.FIT_END, (1, args.batches, 0, args.batches * 32, 0), {})
    pub.close(linger=0.5)
    report = json.loads(monitor.stdout.readline())
    monitor.wait(timeout=30)
    mark_finished(run_dir)
    print(f"monitor received {report['received']} events, {report['gaps']} lost "
          f"(publisher drops: {pub.drops}); last loss {report['last_loss']:.4f}")
    print(f"run directory: {run_dir}")
    return 0 if report["received"] + report["gaps"] == 2 * args.batches + 1 else 1


def monitor(events: str, state: str) -> None:
    from bus import Subscriber

    sub = Subscriber(events, state, topics=["batch_start", "batch_end", "fit_end"])
    joined = sub.connect()
    print(json.dumps({"joined": True, "config": joined.config}), flush=True)
    last_loss = math.nan
    while (msg := sub.recv(timeout=10)) is not None:
        if msg.topic == "batch_end":
            last_loss = msg.data["loss"]
    print(json.dumps({"received": sub.stats.received, "gaps": sub.stats.gaps,
                      "last_loss": last_loss}), flush=True)
    sub.close()


if __name__ == "__main__":
    monitor(*sys.argv[1:3])
