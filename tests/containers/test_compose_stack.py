"""`docker-compose up` with the shipped docker-compose.yml, in real containers.

Grafana is left out (its image cannot be pulled here and Debian has no package; its
dashboard is checked against Prometheus by tests/e2e/test_dashboard.py). Prometheus runs
from the test-only image scripts/container-env.sh builds under the compose file's own tag;
every offloop service runs exactly as shipped, from the image built from the Dockerfile.
"""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from helpers.containers import ROOT, HealthDriver
from helpers.waiting import wait_until

SERVICES = ["keys", "trainer", "monitor", "stopper", "exporter", "prometheus"]
POLL = 0.5  # seconds between polls: each asks podman or Prometheus

# the first test of the tier also prepares the machine and builds the image (minutes)
pytestmark = pytest.mark.timeout(1500)


class Stack:
    """One compose project of the shipped file; `down -v` at the end, whatever happened."""

    def __init__(self, containers, project: str, **variables: str) -> None:
        self.containers, self.project = containers, project
        self.variables = {"GRAFANA_ADMIN_PASSWORD": "a-test-password", **variables}

    def compose(self, *args: str, timeout: float = 300, check: bool = True):
        return self.containers.run("docker-compose", "-p", self.project, "-f", str(ROOT / "docker-compose.yml"),
                                   *args, timeout=timeout, check=check, extra_env=self.variables)

    def name(self, service: str) -> str:
        return f"{self.project}_{service}_1"

    def exit_code(self, service: str, timeout: float = 180) -> int:
        done = self.containers.podman("wait", self.name(service), timeout=timeout)
        return int(done.stdout.strip())

    def logs(self, service: str) -> str:
        done = self.containers.podman("logs", self.name(service), check=False, timeout=60)
        return done.stdout + done.stderr

    def runs_volume(self) -> Path:
        done = self.containers.podman("volume", "inspect", f"{self.project}_runs", "--format", "{{.Mountpoint}}")
        return Path(done.stdout.strip())

    def run_json(self, run: str = "demo") -> dict:
        path = self.runs_volume() / run / "run.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def down(self) -> None:
        self.compose("down", "-v", "--timeout", "5", check=False, timeout=180)


@pytest.fixture
def stack(containers, request):
    made: list[Stack] = []

    def make(**variables: str) -> Stack:
        project = "offloopct" + "".join(c for c in request.node.name if c.isalnum())[-20:].lower()
        made.append(Stack(containers, project, **variables))
        made[-1].down()  # a project left by an interrupted run
        return made[-1]

    yield make
    for one in made:
        one.down()


def prometheus_query(expr: str) -> list:
    url = "http://127.0.0.1:9090/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return json.load(response)["data"]["result"]
    except OSError:
        return []


def prometheus_targets() -> str:
    """Prometheus's own view of its targets, for a failure message: health and last error."""
    try:
        with urllib.request.urlopen("http://127.0.0.1:9090/api/v1/targets", timeout=5) as response:
            targets = json.load(response)["data"]["activeTargets"]
    except OSError as exc:
        return f"Prometheus unreachable: {exc}"
    return "; ".join(f"{t['scrapeUrl']} {t['health']} {t['lastError']!r} at {t['lastScrape']}" for t in targets)


def wait_for_prometheus(condition, timeout: float, what: str, up: Stack):
    """wait_until, failing with what Prometheus and the exporter saw."""
    try:
        return wait_until(condition, timeout, what, POLL)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\ntargets: {prometheus_targets()}\n"
                             f"exporter:\n{up.logs('exporter')[-1500:]}") from None


def test_compose_up_trains_monitors_halts_exports_and_is_scraped(stack):
    up = stack()
    with HealthDriver(up.containers, up.project):
        up.compose("up", "-d", "--no-build", *SERVICES)
        assert up.exit_code("keys", timeout=60) == 0, up.logs("keys")
        # Prometheus reads the run from the exporter over the compose network
        scraped = wait_for_prometheus(lambda: prometheus_query('offloop_step{job="offloop", run="demo"}'), 120,
                                      "Prometheus to scrape offloop_step from the exporter", up)
        assert scraped[0]["metric"]["instance"].startswith("exporter:")
        assert up.exit_code("trainer", timeout=180) == 0, up.logs("trainer")[-3000:]
        for service in ("monitor", "stopper", "exporter"):
            assert up.exit_code(service, timeout=120) == 0, f"{service}:\n{up.logs(service)[-3000:]}"

    final = up.run_json()["extra"]["progress"]["batch"]
    steps = 'max_over_time(offloop_step{job="offloop", run="demo"}[10m])'
    wait_for_prometheus(lambda: any(float(r["value"][1]) == final for r in prometheus_query(steps)), 30,
                        f"the run's last step, {final}, in Prometheus", up)
    trainer = up.logs("trainer")
    assert "eval accuracy" in trainer and "stopped by    EarlyStopper-" in trainer, trainer[-3000:]
    # the stopper service halted the run: its worker is its container's process 1 (await_run
    # execs it), where the demo's own early stopper runs in a child of the trainer
    stopped_by = up.run_json()["extra"]["stopped_by"]
    assert stopped_by["client"] == "EarlyStopper-1", stopped_by
    for service in ("monitor", "stopper", "exporter"):
        assert ", 0 lost" in up.logs(service), f"{service}:\n{up.logs(service)[-2000:]}"
    assert "Starting epoch" in up.logs("monitor")


def test_a_stopped_trainer_checkpoints_and_up_again_resumes_at_that_batch(stack):
    up = stack(OFFLOOP_STEP_DELAY="0.2", OFFLOOP_MAX_DURATION="6ep")
    with HealthDriver(up.containers, up.project):
        up.compose("up", "-d", "--no-build", "keys", "trainer")
        # run.json holds the progress once the run ends; the trainer's own progress lines say it now
        wait_until(lambda: "Starting epoch 2" in up.logs("trainer"), 120, "the trainer to start its second epoch", POLL)
        up.compose("stop", "trainer", timeout=120)  # SIGTERM, then SIGKILL after the 60 s grace
        # 143 (128 + SIGTERM) is the trainer's own exit after its checkpoint; a SIGKILL would be 137
        assert up.exit_code("trainer", timeout=30) == 143, up.logs("trainer")[-3000:]
        first = up.logs("trainer")
        saved = sorted(path.name for path in (up.runs_volume() / "demo" / "checkpoints").glob("*-sigterm.pt"))
        assert len(saved) == 1, (saved, first[-3000:])
        batch = int(saved[0].split("-ba", 1)[1].split("-", 1)[0])

        up.compose("up", "-d", "--no-build", "trainer")
        assert up.exit_code("trainer", timeout=300) == 0, up.logs("trainer")[-3000:]
    resumed = up.logs("trainer")[len(first):] if up.logs("trainer").startswith(first) else up.logs("trainer")
    assert f"resumed from /runs/demo/checkpoints/{saved[0]} at epoch" in resumed, resumed[-3000:]
    assert f", batch {batch}\n" in resumed, resumed[-3000:]
    assert up.run_json()["extra"]["progress"]["batch"] == 6 * 23  # 6 epochs of 23 batches, none twice


def test_killing_the_monitor_leaves_the_trainer_alone_and_a_restarted_monitor_reattaches(stack):
    up = stack(OFFLOOP_STEP_DELAY="0.1", OFFLOOP_MAX_DURATION="8ep")
    with HealthDriver(up.containers, up.project):
        up.compose("up", "-d", "--no-build", "keys", "trainer", "monitor", "exporter")
        wait_until(lambda: "Starting epoch" in up.logs("monitor"), 120, "the monitor to follow the run", POLL)
        epochs_seen = up.logs("monitor").count("Starting epoch")
        up.containers.podman("kill", up.name("monitor"))  # SIGKILL: exit 137, restart: on-failure
        trained = up.logs("trainer").count("Starting epoch")  # the trainer's own progress lines
        wait_until(lambda: up.logs("trainer").count("Starting epoch") > trained, 60,
                   "the trainer to go on to its next epoch without the monitor", POLL)
        up.compose("up", "-d", "--no-build", "monitor")  # what `restart: on-failure` does under a Docker engine
        wait_until(lambda: up.logs("monitor").count("Starting epoch") > epochs_seen, 120,
                   "the restarted monitor to re-attach and follow the next epoch", POLL)
        assert up.exit_code("trainer", timeout=180) == 0, up.logs("trainer")[-3000:]
        assert up.exit_code("exporter", timeout=120) == 0, up.logs("exporter")[-3000:]
        assert up.exit_code("monitor", timeout=60) == 0, up.logs("monitor")[-3000:]
    assert up.run_json()["extra"]["progress"]["batch"] == 8 * 23  # the whole run, untouched
    assert ", 0 lost" in up.logs("exporter"), up.logs("exporter")[-2000:]  # every event reached the other monitor
