"""The Kubernetes manifests of deploy/kubernetes/ (docs/deploy.md): each document valid
against Kubernetes 1.30's schema (strict: no unknown field), the commands they run
accepted by offloop, and the Prometheus configuration they carry accepted by promtool.
No cluster runs here: what that leaves unshown is said in docs/deploy.md."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import yaml

from offloop.workers.spec import build_callback

KUBERNETES = Path(__file__).parent.parent.parent / "deploy" / "kubernetes"
VERSION = "1.30"  # native sidecars (an init container with restartPolicy: Always) need 1.29


def documents() -> list[dict]:
    docs = [doc for path in sorted(KUBERNETES.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text())]
    assert {doc["kind"] for doc in docs} == {"Job", "ConfigMap"}
    return docs


def test_every_manifest_is_valid_kubernetes():
    for doc in documents():
        kubernetes_validate.validate(doc, VERSION, strict=True)


def test_a_manifest_with_an_unknown_field_is_refused():
    job = next(doc for doc in documents() if doc["kind"] == "Job")
    job["spec"]["template"]["spec"]["containers"][0]["comand"] = ["typo"]
    try:
        kubernetes_validate.validate(job, VERSION, strict=True)
    except kubernetes_validate.ValidationError:
        return
    raise AssertionError("a misspelled field passed validation: the test above proves nothing")


def test_the_job_runs_what_offloop_accepts(tmp_path):
    job = next(doc for doc in documents() if doc["kind"] == "Job")
    pod = job["spec"]["template"]["spec"]
    (exporter,), (trainer,) = pod["initContainers"], pod["containers"]
    assert exporter["restartPolicy"] == "Always" and pod["restartPolicy"] == "Never"
    # the exporter's callback spec builds; it serves on the port the pod names `metrics`
    spec = exporter["command"][-1]
    built = build_callback(spec)
    assert built.port == exporter["ports"][0]["containerPort"] and exporter["ports"][0]["name"] == "metrics"
    # the trainer's command line parses (offloop demo --help lists each option it uses)
    assert trainer["command"][:2] == ["offloop", "demo"]
    usage = subprocess.run([sys.executable, "-m", "offloop.cli", "demo", "--help"], capture_output=True,
                           text=True, timeout=60).stdout
    for option in (arg for arg in trainer["command"] if arg.startswith("--")):
        assert option in usage, option
    # both share the run directory the exporter's await_run.py and the probe look in
    assert {m["mountPath"] for m in exporter["volumeMounts"]} == {m["mountPath"] for m in trainer["volumeMounts"]}


def test_the_prometheus_configuration_is_accepted_by_promtool(tmp_path):
    config = yaml.safe_load(next(doc for doc in documents() if doc["kind"] == "ConfigMap")["data"]["prometheus.yml"])
    (job,) = config["scrape_configs"]
    # Debian's Prometheus is built without Kubernetes discovery, so its promtool cannot read
    # that block: it is checked here by shape, and promtool checks the rest with a static
    # target in its place (the relabelling, the intervals, rule_files)
    assert job.pop("kubernetes_sd_configs") == [{"role": "pod"}]
    kept = [r for r in job["relabel_configs"] if r.get("action") == "keep"]
    assert [(r["source_labels"], r["regex"]) for r in kept] == [
        (["__meta_kubernetes_pod_label_app_kubernetes_io_name"], "offloop-training"),
        (["__meta_kubernetes_pod_container_port_name"], "metrics")]
    job["static_configs"] = [{"targets": ["pod:9464"]}]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    promtool = shutil.which("promtool")
    assert promtool, "promtool ships with Debian's prometheus: run `make system-deps`"
    checked = subprocess.run([promtool, "check", "config", "--syntax-only", str(tmp_path / "prometheus.yml")],
                             capture_output=True, text=True, timeout=30)
    assert checked.returncode == 0, checked.stdout + checked.stderr
