"""docker-compose.yml read as Compose reads it: valid, and keeping what the deployment
promises (the trainer on the internal network, healthchecks, pinned torch, Prometheus's
target). The stack itself runs in real containers in tests/containers/."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

from helpers.compose_file import ROOT, compose_config, read_yaml

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
