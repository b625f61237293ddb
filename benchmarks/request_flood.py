"""What each attack of issue 44's audit costs a training run, one attack at a time.

A real Trainer trains an MLP (784-256-256-10, batch 64, synthetic data) in this process
for the whole measurement; another process attacks it, in turn, with each attack below,
every attack phase between two quiet phases of the same length (interleaved, so a drift of
the machine's speed hits both alike). Per attack:

  step_rate_ratio   batches/s during the attack over the mean of the quiet phases beside it
                    (target >= 0.90; beside it, over the spin attack's: what the messages
                    cost beyond the attacker's own CPU)
  request_cpu_ms_s  CPU time of the trainer's threads that read requests (offloop-control,
                    offloop-publisher) and of libzmq's I/O threads, ms per second of attack
  rss_growth_mib    the trainer process's peak RSS during the attack over its RSS when the
                    attack began (target < 64; what an earlier attack left is not charged
                    to this one); beside it `rss_over_start_mib`, over its RSS before the
                    first attack
  max_beat_gap_s    the longest silence between two heartbeats the attacker's own SUB
                    socket heard during the attack (target <= 2; the interval is 0.5 s)
  sent, answered    messages the attacker sent and replies it got (each one refused)
  attacker_cores    the attacker process's CPU time over the attack's length (its libzmq
                    I/O thread writing counts): how much of the machine the attack itself took
  refused           what the trainer's heartbeats said its sockets refused, by kind, at the
                    end of the phase (`Publisher.refusals()`: every refusal counted)
  close_s           (in the summary) how long the trainer's close() took after every attack

Attacks (the request floods from 8 connections, sending as fast as libzmq takes them):
  spin                the same attacker process, heartbeats heard, nothing sent: the floor,
                      what an attacker costs by taking one of the two cores (the trainer
                      runs torch on one thread, so the cores are the training thread's and
                      the attacker's; the trainer's other threads share them)
  control_cheap       64-byte bodies that are not msgpack, to the control socket
  control_wide        16 KiB bodies of 16 000 small objects, well-formed msgpack, no valid
                      request (the costliest body a request may be; the audit's 2)
  control_oversized   60 KiB bodies, refused by their length
  control_huge        4 MiB bodies: past the transport cap, each cuts its connection
  control_given_up    valid halts with wait=1e-9, each from a client of its own: refused by
                      the trainer as given up (the audit's 4, as a flood)
  state_wide          the wide bodies, to the state socket: well-formed state requests (a
                      map may carry more fields), each answered (the audit's 2)
  state_padded        well-formed state requests padded to 4 MiB (the audit's 3a)
  partial_held        40 raw connections to each of the three sockets, each holding all but
                      the last byte of the largest message the socket admits (the audit's 3b)
  subscriptions_long  one SUB socket subscribing 1 500 prefixes of 4 000 bytes (3c)
  subscriptions_short one SUB socket subscribing 20 000 prefixes of 255 bytes, again at each
                      reconnection (3c within the length limit)

What it does not show: an attacker with CURVE keys (a handshake per connection; the same
budget then applies after it), a GPU run, several attackers on several hosts. The run
here has no keys (its subscriptions bounded by FloodCut: bus/subscription_cap.py).

Run: python benchmarks/request_flood.py [--phase S] [--rounds N] [--attacks spin,control_cheap,...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from proc_memory import rss_mib
from torch.utils.data import DataLoader, TensorDataset

ATTACKS = ("spin", "control_cheap", "control_wide", "control_oversized", "control_huge",
           "control_given_up", "state_wide", "state_padded", "partial_held", "subscriptions_long",
           "subscriptions_short")
ROOT = Path(__file__).resolve().parents[1]

ATTACKER = r'''
import json, os, sys, time
import msgpack, zmq
pid = os.getpid()  # client names never seen before, in every round
kind, endpoints, seconds = sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3])
sys.path.insert(0, sys.argv[4])  # the checkout's tests/: helpers.raw_zmtp
from offloop.bus.wire import MAX_SUBSCRIPTION_BYTES, encode_request, request_socket_cap
body = {"control_cheap": b"\xc1" * 64,
        "control_wide": msgpack.packb({"v": 2, "k": "ctl", "x": [[0] * 1000] * 16}),
        "control_oversized": b"\xc1" * (60 << 10),
        "control_huge": b"\xc1" * (4 << 20),
        "state_wide": msgpack.packb({"v": 2, "k": "state_req", "topics": None,
                                     "x": [[0] * 1000] * 16}),
        "state_padded": msgpack.packb({"v": 2, "k": "state_req", "topics": None,
                                       "pad": b"x" * (4 << 20)})}.get(kind)
ctx = zmq.Context()
beats = ctx.socket(zmq.SUB)
beats.setsockopt(zmq.SUBSCRIBE, b"_hb\0")
beats.connect(endpoints["events"])
dealers, held = [], []
if body is not None or kind == "control_given_up":
    for _ in range(8):
        d = ctx.socket(zmq.DEALER)
        d.linger = 0
        d.sndhwm = 64
        d.connect(endpoints["state" if kind.startswith("state") else "control"])
        dealers.append(d)
elif kind == "partial_held":
    from helpers.raw_zmtp import hold_partial
    for name, peer, size in (("control", b"DEALER", request_socket_cap()),
                             ("state", b"DEALER", request_socket_cap()),
                             ("events", b"SUB", MAX_SUBSCRIPTION_BYTES)):
        held += [hold_partial(endpoints[name], peer, size) for _ in range(40)]
elif kind.startswith("subscriptions"):
    flood = ctx.socket(zmq.SUB)
    flood.sndhwm, flood.linger = 0, 0  # every prefix leaves, again at each reconnection
    flood.connect(endpoints["events"])
    count, length = (1500, 4000) if kind == "subscriptions_long" else (20000, 255)
    for i in range(count):
        flood.subscribe(b"%06d" % i + b"x" * (length - 6))
time.sleep(0.5)
while beats.poll(0):
    beats.recv_multipart()
sent = answered = 0
last_beat, gap = time.monotonic(), 0.0
end = time.monotonic() + seconds
while (now := time.monotonic()) < end:
    for d in dealers:
        if kind == "control_given_up":
            body = encode_request("ctl", client=f"given-up-{pid}-{sent}", req=1, op="halt",
                                  args={"reason": "flood"}, t=time.time(), wait=1e-9)
        try:
            d.send(body, zmq.NOBLOCK)
            sent += 1
        except zmq.Again:
            pass
        while d.poll(0):
            d.recv_multipart()
            answered += 1
    while beats.poll(0):
        beats.recv_multipart()
        gap, last_beat = max(gap, now - last_beat), now
    if kind in ("control_huge", "state_padded"):
        time.sleep(0.01)  # each send waits for a reconnection anyway
    elif kind != "spin" and not dealers:
        time.sleep(0.001)  # held or subscribed: listening for heartbeats only
gap = max(gap, time.monotonic() - last_beat)
print(json.dumps({"sent": sent, "answered": answered, "max_beat_gap_s": round(gap, 2),
                  "attacker_cores": round(time.process_time() / seconds, 2)}))
'''


def thread_cpu() -> dict[str, float]:
    """CPU seconds of this process's threads, summed by the name groups reported."""
    groups = {"request": 0.0, "zmq_io": 0.0}
    tick = os.sysconf("SC_CLK_TCK")
    # Python 3.11 names no OS thread: the request threads are found by their native ids
    requests = {t.native_id for t in threading.enumerate()
                if t.name in ("offloop-control", "offloop-publisher")}
    for task in Path("/proc/self/task").iterdir():
        try:
            comm = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        seconds = (int(fields[11]) + int(fields[12])) / tick
        if int(task.name) in requests:
            groups["request"] += seconds
        elif comm.startswith("ZMQbg/IO"):
            groups["zmq_io"] += seconds
    return groups


def rss(field: str = "VmRSS") -> int:
    """This process's resident memory in bytes (VmHWM: its peak since reset_peak())."""
    return int(rss_mib(os.getpid(), field) * 1024) << 10


def reset_peak() -> None:
    """Start VmHWM again from the resident memory now (Linux's clear_refs, value 5)."""
    Path("/proc/self/clear_refs").write_text("5")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", type=float, default=4.0, help="seconds per phase")
    parser.add_argument("--rounds", type=int, default=2, help="times each attack is run")
    parser.add_argument("--attacks", default=",".join(ATTACKS),
                        help="comma-separated attacks to run, of: " + ", ".join(ATTACKS))
    args = parser.parse_args()
    attacks = args.attacks.split(",")
    if "spin" not in attacks or not set(attacks) <= set(ATTACKS):
        parser.error(f"--attacks: spin and any of {', '.join(ATTACKS)}, got {args.attacks!r}")
    from offloop.bus import find_run
    from offloop.trainer import Trainer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, y = torch.randn(4096, 784), torch.randint(0, 10, (4096,))
    model = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10))
    folder = Path(tempfile.mkdtemp(prefix="offloop-flood-"))
    trainer = Trainer(model, DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True), "100000ep",
                      loss_fn=F.cross_entropy, run_dir=folder / "run")
    fit = threading.Thread(target=trainer.fit, daemon=True)
    fit.start()
    while trainer.timestamp.batch < 50:
        time.sleep(0.05)
    endpoints = find_run(str(folder / "run")).endpoints
    baseline_rss, results = rss(), {}

    def phase(attack: str | None) -> dict:
        start_batch, start_rss, cpu = trainer.timestamp.batch, rss(), thread_cpu()
        reset_peak()
        started = time.monotonic()
        child = None
        if attack is not None:
            child = subprocess.Popen([sys.executable, "-c", ATTACKER, attack, json.dumps(endpoints),
                                      str(args.phase), str(ROOT / "tests")],
                                     stdout=subprocess.PIPE, text=True)
        while time.monotonic() - started < args.phase:
            time.sleep(0.05)
        took, peak = time.monotonic() - started, rss("VmHWM")
        rate = (trainer.timestamp.batch - start_batch) / took
        out = {"rate": rate, "peak": peak, "grown": peak - start_rss,
               **{f"{k}_cpu_ms_s": round(1000 * (v - cpu[k]) / took, 1) for k, v in thread_cpu().items()}}
        if child is not None:
            out.update(json.loads(child.communicate(timeout=120)[0].strip().splitlines()[-1]))
            out["refused"] = {k: v for k, v in trainer.publisher.refusals().items() if v}
        return out

    for _ in range(args.rounds):
        for attack in attacks:
            before, during, after = phase(None), phase(attack), phase(None)
            quiet = (before["rate"] + after["rate"]) / 2
            row = results.setdefault(attack, {"step_rate_ratio": [], "rss_growth_mib": [],
                                              "max_beat_gap_s": [], "sent": 0, "answered": 0,
                                              "rates": [], "request_cpu_ms_s": [], "zmq_io_cpu_ms_s": []})
            row["step_rate_ratio"].append(round(during["rate"] / quiet, 3))
            row["rates"].append(during["rate"])
            row["request_cpu_ms_s"].append(during["request_cpu_ms_s"])
            row["zmq_io_cpu_ms_s"].append(during["zmq_io_cpu_ms_s"])
            row.setdefault("attacker_cores", []).append(during["attacker_cores"])
            row["rss_growth_mib"].append(round(during["grown"] / 2**20, 1))
            row.setdefault("rss_over_start_mib", []).append(
                round((during["peak"] - baseline_rss) / 2**20, 1))
            row["max_beat_gap_s"].append(during["max_beat_gap_s"])
            row["sent"] += during["sent"]
            row["answered"] += during["answered"]
            print(json.dumps({"attack": attack, "quiet_batches_per_s": round(quiet, 1),
                              "attacked_batches_per_s": round(during["rate"], 1), **{
                                  k: v for k, v in during.items() if k not in ("rate", "peak", "grown")},
                              "rss_growth_mib": row["rss_growth_mib"][-1]}),
                  flush=True)
    trainer.controller.stop = True
    fit.join(60)
    stats = trainer.control.stats
    summary = {"case": "request_flood", "pid": os.getpid(), "phase_s": args.phase, "rounds": args.rounds,
               "baseline_rss_mib": round(baseline_rss / 2**20, 1)}
    spin = statistics.fmean(results["spin"]["rates"])
    for attack, row in results.items():
        summary[attack] = {"step_rate_ratio_mean": round(statistics.fmean(row["step_rate_ratio"]), 3),
                           "over_spin": round(statistics.fmean(row["rates"]) / spin, 3),
                           "request_cpu_ms_s": max(row["request_cpu_ms_s"]),
                           "zmq_io_cpu_ms_s": max(row["zmq_io_cpu_ms_s"]),
                           "attacker_cores": max(row["attacker_cores"]),
                           "step_rate_ratio_min": min(row["step_rate_ratio"]),
                           "rss_growth_mib_max": max(row["rss_growth_mib"]),
                           "rss_growth_mib": row["rss_growth_mib"],
                           "rss_over_start_mib_max": max(row["rss_over_start_mib"]),
                           "max_beat_gap_s": max(row["max_beat_gap_s"]),
                           "sent": row["sent"], "answered": row["answered"]}
    summary["control_stats"] = {k: getattr(stats, k) for k in ("malformed", "oversized", "received")}
    summary["refused"] = {k: v for k, v in trainer.publisher.refusals().items() if v}
    started = time.monotonic()
    trainer.close()
    summary["close_s"] = round(time.monotonic() - started, 2)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
