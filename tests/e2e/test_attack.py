"""Issue 24's measurement, run end to end: what a local peer can do to a run without keys."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from offloop.bus import PublisherSilent, Subscriber, find_run

BATCHES = 150


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError(f"no VmRSS for {pid}")


def test_a_local_peer_flooding_every_socket_costs_the_trainer_no_memory_and_no_event_goes_uncounted(
        spawn, tmp_path):
    run_dir, steps, go = tmp_path / "run", tmp_path / "steps.json", tmp_path / "go"
    trainer = spawn("slow_trainer", run_dir, BATCHES, 0.03, steps, go)
    pid = trainer.line(timeout=60)["pid"]
    info = find_run(str(run_dir))
    starts, ended = [], threading.Event()
    with Subscriber(info.endpoints["events"], info.endpoints["state"], heartbeat_timeout=20) as every:
        every.connect(join_timeout=20)

        def receive() -> None:  # a subscriber of every topic, reading all the while
            try:
                while not every.finished:
                    msg = every.recv(timeout=0.5)
                    if msg is not None and msg.topic == "batch_start":
                        starts.append(msg.ts[1])
            except PublisherSilent:
                pass
            ended.set()

        reader = threading.Thread(target=receive, daemon=True)
        reader.start()
        time.sleep(1.0)  # the trainer's workers and sockets settle: the baseline is a running trainer
        baseline, peak = _rss(pid), 0
        go.touch()
        attacker = spawn("attacker", info.endpoints["events"], info.endpoints["control"])
        answers = attacker.line(timeout=90)
        while trainer.alive() and not ended.is_set():
            peak = max(peak, _rss(pid))
            time.sleep(0.02)
        report = trainer.line(timeout=90)
        ended.wait(timeout=30)
        lost = every.stats.gaps_by_topic.get("batch_start", 0)

    # the figures docs/reliability.md quotes; shown with `pytest -s`
    print(json.dumps({"case": "attack", "rss_growth_mib": round((peak - baseline) / (1 << 20), 1),
                      "batch_start_received": len(starts), "batch_start_lost": lost, **answers}))
    # the control socket refused every request, at once, and applied none; it cut each
    # connection that sent a message past its transport cap
    assert answers == {"refused": 40, "applied": 0, "cut": 4}, answers
    assert report["done"] == BATCHES  # nothing halted the run
    assert peak - baseline < 64 << 20, f"the trainer grew by {(peak - baseline) >> 20} MiB"  # 1.7 GiB before
    # every batch_start received or counted lost, nearly all received (0 of 150 before)
    assert len(starts) + lost == BATCHES and len(starts) >= 140, (len(starts), lost)
    # the job's own counter, in a worker the trainer started, saw every batch
    assert json.loads(steps.read_text())["steps"] == list(range(1, BATCHES + 1))
