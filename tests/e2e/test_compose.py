"""docker-compose.yml: valid for Compose, and its services' commands working together.

No Docker engine runs here, so the smoke test runs each of the project's own services'
commands as local processes with the file's environment (tests/helpers/compose_local.py
says what is mapped), and Debian's Prometheus with deploy/prometheus.yml's scrape job.
What it does not cover: the image build, the container network (host names are mapped to
127.0.0.1), `depends_on` ordering (the test starts the services in its own order), and
Grafana (its dashboard is checked by test_dashboard.py against Prometheus, not a Grafana).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

from helpers.compose_local import ROOT, LocalService, compose_config, read_yaml, wait_until
from helpers.prometheus_server import Prometheus, free_port

PROJECT_SERVICES = ["keys", "trainer", "monitor", "stopper", "exporter"]


def _prometheus_job(config: dict) -> dict:
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "offloop"]
    return job


def test_compose_file_is_valid_and_keeps_the_trainer_on_the_compose_network():
    config, _ = compose_config()
    services = config["services"]
    assert set(services) == {*PROJECT_SERVICES, "prometheus", "grafana"}
    for name in PROJECT_SERVICES:
        assert services[name]["image"] == "offloop:latest" and services[name]["build"]["context"] == str(ROOT)
    trainer = services["trainer"]
    assert "ports" not in trainer, "the trainer must not publish its sockets on the host"
    assert list(trainer["networks"]) == ["bus"] and config["networks"]["bus"]["internal"] is True
    host = trainer["command"][trainer["command"].index("--host") + 1]
    assert host == "trainer", "the trainer binds its compose-network address only"
    assert services["keys"]["network_mode"] == "none"
    for name in ("prometheus", "grafana"):
        assert all(p.startswith("127.0.0.1:") for p in services[name]["ports"]), services[name]["ports"]

    # the exporter's port and Prometheus's target agree
    exporter = " ".join(services["exporter"]["command"])
    port = re.search(r"PrometheusExporter\(port=(\d+)", exporter).group(1)
    prometheus = read_yaml((ROOT / "deploy/prometheus.yml").read_text())
    assert _prometheus_job(prometheus)["static_configs"][0]["targets"] == [f"exporter:{port}"]

    # every long-running service has a healthcheck, and what waits for one waits for it healthy
    for name, service in services.items():
        assert name == "keys" or service["healthcheck"]["test"][0] == "CMD", name
        for needed, how in (service.get("depends_on") or {}).items():
            assert how["condition"] == ("service_completed_successfully" if needed == "keys" else "service_healthy")

    # Grafana's admin password comes from the environment, with no admin/admin default
    assert services["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == "a-test-password"
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OFFLOOP_", "GRAFANA_"))}
    refused = subprocess.run(["docker-compose", "-f", str(ROOT / "docker-compose.yml"), "config"], cwd=ROOT,
                             capture_output=True, text=True, timeout=60, env=clean)
    assert refused.returncode != 0 and "set GRAFANA_ADMIN_PASSWORD" in refused.stderr, refused.stderr

    gpu, _ = compose_config("docker-compose.yml", "deploy/compose.gpu.yml")
    devices = gpu["services"]["trainer"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]

    # Dockerfile's torch is the one the Makefile pins; promtool accepts the scrape config
    pin = re.search(r"^TORCH_PIN := torch==(\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert f"ARG TORCH_VERSION={pin}\n" in (ROOT / "Dockerfile").read_text()
    promtool = shutil.which("promtool")
    assert promtool, "promtool ships with Debian's prometheus: run `make system-deps`"
    checked = subprocess.run([promtool, "check", "config", "--syntax-only", str(ROOT / "deploy/prometheus.yml")],
                             capture_output=True, text=True, timeout=30)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_compose_services_run_as_local_processes_train_monitor_halt_export_and_are_scraped(tmp_path):
    exporter_port = free_port()
    config, _ = compose_config(env={"OFFLOOP_EXPORTER_PORT": str(exporter_port)})
    services = config["services"]
    volumes = {name: tmp_path / "volumes" / name for name in config["volumes"]}
    for folder in volumes.values():
        folder.mkdir(parents=True)
    logs = tmp_path / "logs"
    logs.mkdir()
    local = {name: LocalService(name, services[name], list(services), volumes, logs)
             for name in PROJECT_SERVICES}

    # Prometheus with the file's scrape job; its targets, service:port, mapped like the rest
    prometheus_config = read_yaml((ROOT / "deploy/prometheus.yml").read_text())
    job = _prometheus_job(prometheus_config)
    (target,) = job["static_configs"][0]["targets"]
    assert target.split(":")[0] == "exporter"
    job["static_configs"][0]["targets"] = [f"127.0.0.1:{exporter_port}"]

    runs = volumes["runs"]
    try:
        with Prometheus(tmp_path / "prometheus", json.dumps(prometheus_config)) as prom:
            assert services["trainer"]["depends_on"]["keys"]["condition"] == "service_completed_successfully"
            assert local["keys"].start().wait(timeout=30) == 0, local["keys"].output()
            assert not local["trainer"].healthy()  # no run yet
            local["trainer"].start()
            # the monitors start once the trainer's healthcheck passes, as compose starts them
            wait_until(local["trainer"].healthy, 60, "the trainer's healthcheck to pass", interval=0.5)
            for name in ("monitor", "stopper", "exporter"):
                assert services[name]["depends_on"]["trainer"]["condition"] == "service_healthy"
                local[name].start()
            wait_until(local["exporter"].healthy, 60, "the exporter's healthcheck to pass", interval=0.5)

            # Prometheus's scrapes only: one of ours could be the very scrape the exporter's
            # linger waits for (on a loaded machine it may first serve after fit_end), and
            # Prometheus would then never read the run
            prom.wait_for('max_over_time(offloop_step{job="offloop", run="demo", rank="0"}[10m])',
                          lambda r: bool(r), timeout=45)

            code = local["trainer"].wait(timeout=55)
            assert code == 0, local["trainer"].output()
            assert not local["trainer"].healthy()  # the run has finished
            for name in ("monitor", "stopper", "exporter"):
                assert local[name].wait(timeout=25) == 0, f"{name}:\n{local[name].output()}"

            info = json.loads((runs / "demo" / "run.json").read_text())
            final = info["extra"]["progress"]["batch"]
            scraped = prom.wait_for('max_over_time(offloop_step{job="offloop", run="demo"}[10m])',
                                    lambda r: r and float(r[0]["value"][1]) == final, timeout=10)
            assert scraped
            up = prom.query('max_over_time(up{job="offloop"}[10m])')
            assert up and up[0]["value"][1] == "1"
    finally:
        for service in local.values():
            service.stop()

    # the trainer used the keys the keys service made, on the address it was given
    # (the trainer's own workers' key lives in its memory, not in the folder), each with its role
    authorized = {p.name: p.read_text() for p in (volumes["keys"] / "authorized").iterdir()}
    assert info["curve_public"] and sorted(authorized) == ["exporter.key", "monitor.key", "stopper.key"]
    assert ['role = "monitor"' in authorized[f"{name}.key"] for name in ("exporter", "monitor", "stopper")] == [
        True, True, False]
    assert all(e.startswith("tcp://127.0.0.1:") for e in info["endpoints"].values()), info["endpoints"]
    # the stopper service halted the run (not the demo's own, slower, early stopper)
    stopped_by = info["extra"]["stopped_by"]
    assert stopped_by and stopped_by["client"] == f"EarlyStopper-{local['stopper'].proc.pid}", stopped_by
    # the monitor received: progress on its console, metrics in its JSONL log
    assert "Starting epoch" in local["monitor"].output()
    lines = [json.loads(x) for x in (runs / "demo" / "monitor-metrics.jsonl").read_text().splitlines()]
    assert any("MulticlassAccuracy" in line for line in lines), lines

