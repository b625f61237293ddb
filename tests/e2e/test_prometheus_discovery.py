"""Many runs, one Prometheus: every live exporter lists itself for Prometheus's file
service discovery, and a real Prometheus with one `file_sd_configs` job scrapes two
concurrent runs, then drops each as it ends, with no edit to its configuration."""

from __future__ import annotations

import subprocess
import sys

from helpers.prometheus_server import Prometheus

from offloop.workers.callbacks.prometheus_targets import TargetFile


def file_sd_config(pattern: str) -> str:
    return ("global:\n  scrape_interval: 500ms\n  scrape_timeout: 500ms\n"
            "scrape_configs:\n  - job_name: offloop\n    file_sd_configs:\n"
            f"      - files: ['{pattern}']\n        refresh_interval: 1s\n")


def up(prom: Prometheus) -> dict[str, str]:
    """instance -> value of every live `up` series of the job."""
    return {r["metric"]["instance"]: r["value"][1] for r in prom.query('up{job="offloop"}')}


def test_prometheus_finds_two_concurrent_runs_and_drops_each_as_it_ends(tmp_path, spawn):
    targets = tmp_path / "targets"
    with Prometheus(tmp_path / "prometheus", file_sd_config(str(targets / "*.json")), targets=0) as prom:
        runs = {}
        for name in ("first", "second"):
            child = spawn("exported_trainer", str(tmp_path / name), str(targets), str(tmp_path / f"stop-{name}"))
            runs[name] = (child, child.line(timeout=60)["run_name"])
        assert {run for _, run in runs.values()} == {"first", "second"}
        prom.wait_for('up{job="offloop"}', lambda r: len(r) == 2 and all(x["value"][1] == "1" for x in r),
                      timeout=60)
        prom.wait_for("offloop_step", lambda r: {x["metric"]["run"] for x in r} == {"first", "second"}, timeout=30)
        assert len(list(targets.glob("*.json"))) == 2

        (tmp_path / "stop-first").touch()
        first = runs["first"][0]
        assert first.line(timeout=60)["done"] > 0 and first.wait(timeout=30) == 0
        assert len(list(targets.glob("*.json"))) == 1  # its exporter took its file away
        prom.wait_for('up{job="offloop"}', lambda r: len(r) == 1, timeout=30)
        prom.wait_for("offloop_step", lambda r: {x["metric"]["run"] for x in r} == {"second"}, timeout=30)

        (tmp_path / "stop-second").touch()
        second = runs["second"][0]
        assert second.line(timeout=60)["done"] > 0 and second.wait(timeout=30) == 0
        assert list(targets.glob("*.json")) == []
        prom.wait_for('up{job="offloop"}', lambda r: r == [], timeout=30)


def test_a_killed_exporters_file_is_removed_by_the_next_one(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    stale = tmp_path / f"oldrun-rank0-{dead.pid}.json"
    stale.write_text('[{"targets": ["127.0.0.1:1"], "labels": {}}]')
    live = tmp_path / "other-rank0-1.json"  # pid 1 is alive: kept
    live.write_text('[{"targets": ["127.0.0.1:2"], "labels": {}}]')
    written = TargetFile(tmp_path, "new run/1", 0).write("0.0.0.0", 9464, {})
    assert not stale.exists() and live.exists() and written.exists()
    assert "new_run_1-rank0-" in written.name
    target = written.read_text()
    assert ":9464" in target and "0.0.0.0" not in target  # listed by the host's name


def test_a_bad_targets_dir_is_named():
    import pytest

    from offloop.callbacks import PrometheusExporter

    with pytest.raises(ValueError, match="targets_dir must be a folder"):
        PrometheusExporter(targets_dir=5)
