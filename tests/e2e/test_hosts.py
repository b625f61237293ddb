"""Several hosts on one machine (network namespaces, tests/helpers/netns.py), with CURVE keys:
a trainer host, a monitor host and a Prometheus host on one private subnet.

A partition of the monitor for 10 s in the middle of a run costs the trainer nothing; the
monitor (`offloop worker`) reports it, counts exactly what it missed, takes the state again
on heal, and a halt it sends after the heal is applied once. Killing every process of the
monitor host leaves the trainer to finish, while Prometheus on its own host goes on
scraping the run's exporter across the links.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import Proc
from helpers.host_probe import FloodProbe
from helpers.netns import Network
from helpers.prometheus_server import Prometheus, scrape_config
from helpers.waiting import wait_until

from offloop.bus import Subscriber
from offloop.bus.security import load_client_keys

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
PARTITION = 10.0  # seconds the monitor host is cut off
BATCH_SECONDS = 0.02
EXPORTER_PORT = 9464

_CANNOT = Network.skip_reason()
pytestmark = pytest.mark.skipif(_CANNOT is not None, reason=_CANNOT or "")


def offloop(*args: str) -> list[str]:
    return [sys.executable, "-m", "offloop.cli", *args]


def make_keys(folder: Path) -> None:
    """The trainer's keys, a `monitor` client that may halt, and the test's read-only `observer`."""
    for client, role in (("monitor", "control"), ("observer", "monitor")):
        subprocess.run(offloop("keys", str(folder), "--client", client, "--role", role), env=ENV,
                       check=True, capture_output=True, timeout=60)


def notes(path: Path) -> list[dict]:
    """The HostProbe's JSON lines so far."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def start_trainer(net: Network, tmp: Path, keys: Path, batches: int, pace: float = BATCH_SECONDS,
                  **extra) -> tuple[Proc, dict, Path]:
    run_dir, go = tmp / "run", tmp / "go"
    cmd = [sys.executable, str(ROOT / "tests" / "programs" / "host_trainer.py"), "--run-dir", run_dir,
           "--keys", keys, "--host", net.addr["trainer"], "--go", go, "--batches", batches,
           "--batch-seconds", pace, *[str(a) for kv in extra.items() for a in kv]]
    trainer = Proc(net.popen("trainer", cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             stdin=subprocess.DEVNULL, env=ENV))
    return trainer, trainer.line(timeout=60), go


def start_monitor(net: Network, tmp: Path, keys: Path, state: str, name: str, trigger: str = "",
                  probe_class: str = "HostProbe"):
    """`offloop worker` with a HostProbe on the monitor host; its stderr in a file."""
    probe, err = tmp / f"{name}.jsonl", tmp / f"{name}.stderr"
    spec = f"helpers.host_probe:{probe_class}({str(probe)!r}, {trigger!r})"
    with err.open("wb") as out:
        proc = net.popen("monitor", offloop("worker", state, spec, "--keys", str(keys), "--key-name", "monitor",
                                            "--heartbeat-timeout", "2", "--give-up-after", "60", "--quiet"),
                         stdout=subprocess.DEVNULL, stderr=out, stdin=subprocess.DEVNULL, env=ENV)
    wait_until(lambda: "joined run" in err.read_text() or proc.poll() is not None, 60, f"{name} to join", interval=0.05)
    assert proc.poll() is None, err.read_text()
    return proc, probe, err


class Observer:
    """The test's own subscriber (read-only key), from its own namespace: what the trainer
    published, taken in a thread until the run's stream closes."""

    def __init__(self, endpoints: dict, keys: Path, topics: list[str]) -> None:
        self.sub = Subscriber(endpoints["events"], endpoints["state"], topics=topics, heartbeat_timeout=30,
                              curve=load_client_keys(keys, "observer"))
        self.sub.connect(join_timeout=30)
        self.got: list = []
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._take, daemon=True)
        self._thread.start()

    def _take(self) -> None:
        try:
            while not self.sub.finished:
                msg = self.sub.recv(timeout=0.1)
                if msg is not None and not msg.from_state:
                    self.got.append(msg)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            self.error = exc

    def step(self) -> int:
        return max((m.ts[1] for m in list(self.got) if m.topic == "batch_end"), default=0)

    def finish(self, timeout: float = 60) -> list:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the run's stream never closed"
        assert self.error is None, self.error
        self.sub.close()
        return self.got


@pytest.fixture
def hosts():
    with Network(["trainer", "monitor", "prometheus"]) as net:
        yield net


MONITOR_TOPICS = {  # what each probe's worker takes: its callback's topics and the run's low-rate ones
    "HostProbe": {"fit_start", "batch_end", "fit_end", "eval_end"},
    "FloodProbe": {"fit_start", "batch_end", "fit_end", "eval_end", *FloodProbe.state_topics},
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("probe_class, pace", [("HostProbe", BATCH_SECONDS), ("FloodProbe", 0.005)],
                         ids=["quiet", "flood"])
def test_a_partitioned_monitor_reports_counts_resyncs_and_its_halt_after_the_heal_applies_once(
        hosts, tmp_path, probe_class, pace):
    """quiet: a batch_end every 20 ms, which the queues hold through the partition; flood: a
    dozen topics a batch every 5 ms, a burst each, more than the trainer's queue for the
    monitor holds (20 messages: the default's 10 000 bursts would hold a partition this long)."""
    net, keys = hosts, tmp_path / "keys"
    make_keys(keys)
    flood = {"--subscriber-hwm": 20, "--burst-interval": 0} if probe_class == "FloodProbe" else {}
    trainer, started, go = start_trainer(net, tmp_path, keys, 100_000, pace, **flood)  # ends by the monitor's halt
    endpoints = started["endpoints"]
    assert endpoints["events"].startswith(f"tcp://{net.addr['trainer']}:")
    trigger = tmp_path / "halt-now"
    monitor, probe, err = start_monitor(net, tmp_path, keys, endpoints["state"], "monitor", str(trigger),
                                        probe_class)
    observer = Observer(endpoints, keys, sorted(MONITOR_TOPICS[probe_class] | {"control_request"}))
    go.touch()
    wait_until(lambda: len(notes(probe)) > 50, 60, "the monitor to handle 50 batches", interval=0.05)

    cut_at = time.time()
    net.cut("monitor")
    wait_until(lambda: "partitioned or trainer gone" in err.read_text(), 10, "the monitor's report", interval=0.05)
    time.sleep(max(0.0, cut_at + PARTITION - time.time()))  # the partition's length is the test
    net.heal("monitor")
    healed_at, step_at_heal = time.time(), observer.step()
    heard = wait_until(lambda: re.search(r"heard from \S+ again after ([\d.]+)s; state (\w+); caught up: "
                                       r"(\d+) events lost meanwhile \(counted\)", err.read_text()),
                     60, "the heal report", interval=0.05)
    assert heard.group(2) == "resynced", err.read_text()
    wait_until(lambda: max((n.get("step", 0) for n in notes(probe)), default=0) > step_at_heal + 5, 60,
             "the monitor to handle batches trained after the heal", interval=0.05)
    trigger.touch()

    done = trainer.line(timeout=60)
    assert trainer.wait(timeout=30) == 0, trainer.stderr()
    assert monitor.wait(timeout=60) == 0, err.read_text()  # fit_end reached it: it exits 0
    got = observer.finish()
    report = err.read_text()

    # the halt, sent after the heal, applied once: acked, the run stopped at that batch
    acks = [n for n in notes(probe) if "ack" in n]
    assert len(acks) == 1 and acks[0]["ack"]["ok"], acks
    assert done["done"] == acks[0]["ack"]["step"] > step_at_heal
    assert done["stopped_by"]["reason"] == "monitor host, after the heal"
    assert [m.topic for m in got].count("control_request") == 1
    assert [m.data["stopped_by"]["reason"] for m in got if m.topic == "fit_end"] == ["monitor host, after the heal"]

    # exact counting: every event of the monitor's topics (since its join: init came in the
    # state it joined with) was handled once or counted lost. What was published, the test's
    # own subscriber (never cut off, nothing lost) received: each event once
    summary = re.search(r"handled (\d+) events, (\d+) lost, (\d+) duplicates, \d+ callback errors; "
                        r"1 silences waited out, 1 resyncs folding in (\d+) values", report)
    assert summary, report
    handled, lost, duplicates, resynced = map(int, summary.groups())
    assert observer.sub.stats.gaps == 0 and observer.sub.stats.duplicates == 0
    published = len({(m.topic, m.tseq) for m in got if m.topic in MONITOR_TOPICS[probe_class]})
    assert handled + lost == published and duplicates == 0
    assert published == done["done"] * (len(MONITOR_TOPICS[probe_class]) - 3) + 2  # a batch's, and fit_start/end
    # what the heal report said the silence cost: all of it, or all but what a busy monitor
    # lost afterwards
    assert int(heard.group(3)) <= lost
    if probe_class == "FloodProbe":
        assert int(heard.group(3)) > 0  # the partition cost the monitor events, each one counted
    steps = [n["step"] for n in notes(probe) if "step" in n]
    assert len(steps) == len(set(steps)) and steps == sorted(steps)
    assert done["drops"] == 0

    # training never waited: it kept its pace through the partition
    times = done["batch_times"]
    before = [b - a for a, b in zip(times, times[1:], strict=False) if b < cut_at]
    during = [b - a for a, b in zip(times, times[1:], strict=False) if cut_at <= a and b <= healed_at]
    expected = PARTITION * len(before) / sum(before)  # batches at the pace kept before the cut
    print(json.dumps({"case": f"partition, {probe_class}", "published": published, "batches": done["done"], "handled": handled, "lost": lost,
                      "duplicates": duplicates, "resynced_values": resynced,
                      "silence_s": float(heard.group(1)), "lost_reported_at_heal": int(heard.group(3)),
                      "batches_during_partition": len(during), "expected_at_pace": round(expected),
                      "median_batch_s_before": round(statistics.median(before), 4),
                      "median_batch_s_during": round(statistics.median(during), 4),
                      "max_batch_s_before": round(max(before), 4), "max_batch_s_during": round(max(during), 4)}))
    assert len(during) >= 0.5 * expected, "training slowed down while the monitor was cut off"
    assert max(during) < 1.0, "a batch waited while the monitor was cut off"
    assert float(heard.group(1)) >= PARTITION - 2.5  # the silence the monitor saw is the partition


@pytest.mark.timeout(300)
def test_killing_the_monitor_host_leaves_the_trainer_and_the_prometheus_host_unaffected(hosts, tmp_path):
    net, keys = hosts, tmp_path / "keys"
    make_keys(keys)
    batches = 750  # 15 s at the pace
    target = f"{net.addr['trainer']}:{EXPORTER_PORT}"
    prom = Prometheus(tmp_path / "prometheus", scrape_config([target]), host=net.addr["prometheus"],
                      launcher=["ip", "netns", "exec", net.netns["prometheus"]])
    with prom:
        trainer, started, go = start_trainer(net, tmp_path, keys, batches, **{"--exporter-port": EXPORTER_PORT})
        monitors = [start_monitor(net, tmp_path, keys, started["endpoints"]["state"], f"monitor{i}")
                    for i in range(2)]
        go.touch()
        prom.wait_for(f'offloop_step{{instance="{target}"}}', lambda r: r and float(r[0]["value"][1]) > 0, 60)
        wait_until(lambda: all(len(notes(probe)) > 20 for _, probe, _ in monitors), 60, "the monitors to work", interval=0.05)
        killed = net.kill_host("monitor")
        assert {proc.pid for proc, _, _ in monitors} <= set(killed)
        killed_at = max(n.get("step", 0) for _, probe, _ in monitors for n in notes(probe))
        # scraped across the links after the monitors died
        prom.wait_for(f'max_over_time(offloop_step{{instance="{target}"}}[5m])',
                      lambda r: r and float(r[0]["value"][1]) > killed_at + 20, 60)
        done = trainer.line(timeout=120)
        assert trainer.wait(timeout=30) == 0
    stderr = [line for line in trainer.stderr().splitlines() if line.strip()]
    assert done["done"] == batches and done["stopped_by"] is None
    assert all(proc.wait(timeout=10) == -9 for proc, _, _ in monitors)
    print(json.dumps({"case": "monitor host killed", "killed_pids": len(killed), "killed_at_step": killed_at,
                      "batches": done["done"], "trainer_stderr": stderr}))
    assert len(stderr) <= 1, stderr  # at most a log line


@pytest.mark.timeout(300)
def test_a_monitor_on_another_host_follows_and_halts_the_run_through_a_relay_host(tmp_path):
    """trainer host -> relay host -> monitor host, CURVE keys on both sides of the relay: the
    monitor knows only the relay's endpoint, handles or counts every event of its topics,
    and its halt goes through the relay and is applied once; the relay exits with the run."""
    with Network(["trainer", "relay", "monitor"]) as net:
        keys = tmp_path / "keys"
        make_keys(keys)
        subprocess.run(offloop("keys", str(keys), "--client", "relay", "--role", "control"), env=ENV,
                       check=True, capture_output=True, timeout=60)
        trainer, started, go = start_trainer(net, tmp_path, keys, 100_000)  # ends by the monitor's halt
        announced, relay_err = tmp_path / "relayed", tmp_path / "relay.stderr"
        with relay_err.open("wb") as out:
            relay = net.popen("relay", offloop("relay", started["endpoints"]["state"], "--host", net.addr["relay"],
                                               "--keys", str(keys), "--key-name", "relay", "--announce",
                                               str(announced)),
                              stdout=subprocess.DEVNULL, stderr=out, stdin=subprocess.DEVNULL, env=ENV)
        run_json = announced / started["run_name"] / "run.json"
        wait_until(lambda: run_json.exists() or relay.poll() is not None, 60, "the relay to announce the run", interval=0.05)
        assert relay.poll() is None, relay_err.read_text()
        relayed = json.loads(run_json.read_text())["endpoints"]
        assert all(e.startswith(f"tcp://{net.addr['relay']}:") for e in relayed.values()), relayed
        trigger = tmp_path / "halt-now"
        monitor, probe, err = start_monitor(net, tmp_path, keys, relayed["state"], "monitor", str(trigger))
        observer = Observer(started["endpoints"], keys, sorted(MONITOR_TOPICS["HostProbe"] | {"control_request"}))
        go.touch()
        wait_until(lambda: len(notes(probe)) > 50, 60, "the monitor to handle 50 batches through the relay", interval=0.05)
        trigger.touch()

        done = trainer.line(timeout=60)
        assert trainer.wait(timeout=30) == 0, trainer.stderr()
        assert monitor.wait(timeout=60) == 0, err.read_text()
        assert relay.wait(timeout=60) == 0, relay_err.read_text()  # the run's final heartbeats end it
        got = observer.finish()

    acks = [n for n in notes(probe) if "ack" in n]
    assert len(acks) == 1 and acks[0]["ack"]["ok"] and done["done"] == acks[0]["ack"]["step"], acks
    assert [m.topic for m in got].count("control_request") == 1
    summary = re.search(r"handled (\d+) events, (\d+) lost, (\d+) duplicates", err.read_text())
    assert summary, err.read_text()
    handled, lost, duplicates = map(int, summary.groups())
    published = len({(m.topic, m.tseq) for m in got if m.topic in MONITOR_TOPICS["HostProbe"]})
    assert handled + lost == published and duplicates == 0
    relay_report = relay_err.read_text()
    assert "finished; forwarded" in relay_report and "and 1 control requests, refused 0" in relay_report, \
        relay_report
    print(json.dumps({"case": "through a relay host", "batches": done["done"], "published": published,
                      "handled": handled, "lost": lost}))
