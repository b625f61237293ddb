"""The shipped alert rules (deploy/prometheus-alerts.yml): valid for the real `promtool`,
each firing on the series that should raise it in promtool's rule unit tests, and loaded
by a real Prometheus that raises them from a live exporter."""

from __future__ import annotations

import math
import shutil
import subprocess
import time
from pathlib import Path

from helpers.exporter_feed import ExporterFeed
from helpers.prometheus_server import Prometheus, free_port

from offloop.workers.callbacks import PrometheusExporter

DEPLOY = Path(__file__).parent.parent.parent / "deploy"
RULES = DEPLOY / "prometheus-alerts.yml"


def promtool(*args: str) -> str:
    binary = shutil.which("promtool")
    assert binary, "the tests need Debian's `prometheus` (its promtool): run `make system-deps`"
    result = subprocess.run([binary, *args], capture_output=True, text=True, timeout=60, cwd=DEPLOY)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_the_rules_are_valid_and_each_fires_when_it_should():
    assert "4 rules found" in promtool("check", "rules", RULES.name)
    assert "SUCCESS" in promtool("test", "rules", "prometheus-alerts.test.yml")
    # the compose Prometheus loads them
    assert "/etc/prometheus/alerts.yml" in (DEPLOY / "prometheus.yml").read_text()


def test_a_real_prometheus_raises_them_from_a_live_exporter(tmp_path):
    port = free_port()
    exporter = PrometheusExporter(port=port, targets_dir=None)
    feed = ExporterFeed(exporter, "alerting")
    # the trainer's last event was published 200 s ago, and its loss is NaN
    t = time.time() - 200
    feed.event("init", t, (0, 0, 0, 0, 0), config={"run_name": "alerting"})
    feed.event("batch_end", t, (0, 1, 1, 32, 0), loss=math.nan, lr=[0.1])
    rules = tmp_path / "alerts.yml"
    rules.write_text(RULES.read_text())
    config = ("global:\n  scrape_interval: 500ms\n  scrape_timeout: 500ms\n  evaluation_interval: 500ms\n"
              f"rule_files: ['{rules}']\n"
              f"scrape_configs:\n  - job_name: offloop\n    static_configs:\n      - targets: ['127.0.0.1:{port}']\n")
    try:
        with Prometheus(tmp_path / "prometheus", config) as prom:
            firing = prom.wait_for('ALERTS{alertname="OffloopLossNotFinite", alertstate="firing"}',
                                   lambda r: len(r) == 1, timeout=30)
            assert firing[0]["metric"]["run"] == "alerting" and firing[0]["metric"]["severity"] == "critical"
            # stalled for 200 s: pending at once, firing after its `for: 1m` (promtool's test above)
            prom.wait_for('ALERTS{alertname="OffloopRunStalled", alertstate="pending"}',
                          lambda r: len(r) == 1 and r[0]["metric"]["run"] == "alerting", timeout=30)
            assert prom.query('ALERTS{alertname="OffloopTrainerDown"}') == []
    finally:
        exporter.close(feed.state, feed.logger)
