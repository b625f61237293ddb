"""The Grafana dashboard: valid JSON, provisioned consistently, and every query it makes
answered by a real Prometheus that scraped a real exporter during a real run."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import time
import uuid

import torch
import torchmetrics
from helpers.compose_file import ROOT, compose_config, read_yaml
from helpers.exporter_feed import ExporterFeed
from helpers.prometheus_server import Prometheus, free_port, scrape, scrape_config
from prometheus_client.parser import text_string_to_metric_families
from torch import nn

from offloop.trainer import Trainer
from offloop.workers import Callback, CallbackRuntime
from offloop.workers.callbacks import PrometheusExporter

DASHBOARD = ROOT / "deploy/grafana/dashboards/offloop.json"
PROVISIONING = ROOT / "deploy/grafana/provisioning"
#: PromQL words a dashboard query may use besides metric names
PROMQL = {"rate", "irate", "increase", "sum", "max", "min", "avg", "by", "without", "max_over_time",
          "min_over_time", "avg_over_time", "delta", "deriv", "time", "timestamp", "label_values",
          "offset", "and", "or", "unless", "on", "ignoring", "group_left", "group_right", "clamp_min"}
#: series only a run on a GPU has: a CPU run leaves them empty, so their panels are checked
#: by test_gpu_panels_are_answered_from_a_stream_carrying_cuda_allocator_counters
GPU_ONLY = {"offloop_gpu_memory_allocated_bytes", "offloop_gpu_memory_reserved_bytes",
            "offloop_gpu_memory_max_allocated_bytes"}


def _targets(dashboard: dict) -> list[tuple[str, str]]:
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel["targets"]]


def _concrete(expr: str, run: str = ".*") -> str:
    """A dashboard query as Grafana sends it, with its variables filled in."""
    return expr.replace("$__rate_interval", "10s").replace("$run", run)


def _metric_names(expr: str) -> set[str]:
    """Identifiers outside label matchers, ranges and strings that are not PromQL words."""
    bare = re.sub(r'"[^"]*"|\{[^}]*\}|\[[^\]]*\]', " ", expr)
    words = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", bare))
    return words - PROMQL


def test_dashboard_json_is_valid_and_provisioned_with_its_data_source():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "offloop" and dashboard["title"] and dashboard["schemaVersion"] >= 36
    datasources = read_yaml((PROVISIONING / "datasources/prometheus.yml").read_text())["datasources"]
    (source,) = datasources
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    providers = read_yaml((PROVISIONING / "dashboards/offloop.yml").read_text())["providers"]
    assert providers[0]["type"] == "file"

    grafana = compose_config()[0]["services"]["grafana"]
    mounts = {v.split(":")[0]: v.split(":")[1] for v in grafana["volumes"]}
    assert mounts[str(ROOT / "deploy/grafana/provisioning")] == "/etc/grafana/provisioning"
    assert mounts[str(DASHBOARD.parent)] == providers[0]["options"]["path"]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{providers[0]['options']['path']}/{DASHBOARD.name}"

    wanted = {"Loss", "Learning rate", "Throughput", "Eval metrics", "Gradient norm", "Memory",
              "Drops, gaps and refusals"}
    assert wanted <= {p["title"] for p in dashboard["panels"]}
    ids, cells = set(), set()
    for panel in dashboard["panels"]:
        assert panel["id"] not in ids
        ids.add(panel["id"])
        # every panel reads the data source the `datasource` variable picks, so the dashboard
        # imports into any Grafana; provisioned here, it defaults to the compose data source
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}" and target["expr"].strip()
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        cell = {(pos["x"] + dx, pos["y"] + dy) for dx in range(pos["w"]) for dy in range(pos["h"])}
        assert not cell & cells, f"panel {panel['title']} overlaps another"
        cells |= cell
    chooser, variable = dashboard["templating"]["list"]
    assert chooser["name"] == "datasource" and chooser["type"] == "datasource"
    assert chooser["query"] == "prometheus" and chooser["current"]["value"] == source["uid"]
    assert variable["name"] == "run" and variable["datasource"]["uid"] == "${datasource}"

    # every query is PromQL Prometheus 2.42 accepts
    promtool = shutil.which("promtool")
    assert promtool, "promtool ships with Debian's prometheus: run `make system-deps`"
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}", "expr": _concrete(expr)}
        for i, (_, expr) in enumerate(_targets(dashboard))]}]}
    checked = subprocess.run([promtool, "check", "rules", "/dev/stdin"], input=json.dumps(rules),
                             capture_output=True, text=True, timeout=30)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def _step(text: str) -> float:
    for family in text_string_to_metric_families(text):
        if family.name == "offloop_step" and family.samples:
            return family.samples[0].value
    return -1.0


class _Batches:
    def __init__(self, n: int, delay: float) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        gen = torch.Generator().manual_seed(1)
        for _ in range(self.n):
            time.sleep(self.delay)
            x = torch.randn(8, 8, generator=gen)
            yield x, (x[:, 0] > 0).long()


class _Mlp(nn.Module):
    """A classifier that counts its flops, so throughput panels have flops and MFU."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))

    def forward(self, x):
        return self.net(x)

    def flops_per_batch(self, batch) -> int:
        return 6 * len(batch[0]) * (8 * 16 + 16 * 2)


class _CheckpointOnce(Callback):
    """Asks for one checkpoint, so the control and checkpoint panels have data."""

    def batch_end(self, state, logger) -> None:
        if state.timestamp.batch == 20:
            self.request_checkpoint("dashboard")


def test_every_dashboard_query_is_answered_from_a_real_run(tmp_path):
    dashboard = json.loads(DASHBOARD.read_text())
    port = free_port()
    run = f"dash-{uuid.uuid4().hex[:6]}"
    texts: list[str] = []
    with Prometheus(tmp_path / "prometheus", scrape_config([f"127.0.0.1:{port}"])) as prom:
        started = time.time()
        trainer = Trainer(_Mlp(), _Batches(30, 0.05), "2ep", loss_fn=nn.functional.cross_entropy,
                          eval_dataloader=[(torch.randn(16, 8), torch.randint(0, 2, (16,)))],
                          eval_interval="10ba", eval_metrics=torchmetrics.classification.MulticlassAccuracy(num_classes=2),
                          num_tokens_fn=lambda batch: batch[0].numel(), run_dir=tmp_path / "run",
                          run_name=run, seed=2)
        exporter = PrometheusExporter(port=port, linger=10, gpu_flops_available=1e9, window_size=5)
        worker = CallbackRuntime(str(tmp_path / "run"), [_CheckpointOnce(), exporter],
                                 destinations=[], heartbeat_timeout=30)
        worker.connect()
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        done = threading.Event()

        def scraper() -> None:
            # halfway through, and no later: a scrape after fit_end would be the one the
            # exporter lingers for, and Prometheus must be the one that gets the last values
            while not done.is_set():
                try:
                    texts.append(scrape(f"http://127.0.0.1:{port}/metrics", timeout=1))
                    if _step(texts[-1]) >= 30:
                        return
                except OSError:
                    pass
                done.wait(0.2)

        scraping = threading.Thread(target=scraper, daemon=True)
        scraping.start()
        try:
            trainer.fit()
        finally:
            trainer.close()
            thread.join(timeout=30)
            done.set()
            scraping.join(timeout=5)
        assert not thread.is_alive() and trainer.checkpoints
        prom.wait_for(f'max_over_time(offloop_step{{run="{run}"}}[10m])',
                      lambda r: r and float(r[0]["value"][1]) == trainer.timestamp.batch)

        assert run in prom.api("label/run/values", **{"match[]": "offloop_step"})
        answers = {}
        for title, expr in _targets(dashboard):
            result = prom.api("query_range", query=_concrete(expr, run), start=started,
                              end=time.time(), step="0.5")["result"]
            answers[(title, expr)] = result

    exposed: set[str] = set()
    with_samples: set[str] = set()
    assert texts, "the exporter was never scraped by the test"
    for text in texts:
        for family in text_string_to_metric_families(text):
            names = {family.name, f"{family.name}_total"} if family.type == "counter" else {family.name}
            exposed |= names
            if family.samples:
                with_samples |= names
    for (title, expr), result in answers.items():
        names = _metric_names(expr)
        assert names and names <= exposed, f"panel {title}: {expr} uses {names - exposed}, not exposed"
        if names & GPU_ONLY:
            assert names <= GPU_ONLY, f"panel {title}: {expr} mixes GPU-only and other series"
            continue
        assert names <= with_samples, f"panel {title}: {expr}: {names - with_samples} had no samples"
        assert result, f"panel {title}: {expr} answered nothing from a real run"


def test_gpu_panels_are_answered_from_a_stream_carrying_cuda_allocator_counters(tmp_path):
    """The GPU-only panels, which a CPU run cannot fill: an exporter fed the batch_end snapshots
    a CUDA run publishes (its allocator counters under `memory`), scraped by a real Prometheus."""
    gpu_panels = [(title, expr) for title, expr in _targets(json.loads(DASHBOARD.read_text()))
                  if _metric_names(expr) & GPU_ONLY]
    assert gpu_panels, "the dashboard has no GPU memory panel"
    port, run = free_port(), f"gpu-{uuid.uuid4().hex[:6]}"
    exporter = PrometheusExporter(port=port, linger=0)
    feed = ExporterFeed(exporter, run)
    config = {"run_name": run, "device_name": "NVIDIA H100 80GB HBM3", "precision": "amp_bf16"}
    started = time.time()
    feed.event("init", started, (0, 0, 0, 0, 0), config=config)
    feed.event("fit_start", started, (0, 0, 0, 0, 0), config=config)
    memory = {"allocated_bytes": 1 << 30, "reserved_bytes": 2 << 30, "max_allocated_bytes": 3 << 30}
    try:
        with Prometheus(tmp_path / "prometheus", scrape_config([f"127.0.0.1:{port}"])) as prom:
            for step in range(1, 6):  # several scrapes see the counters
                feed.event("batch_end", time.time(), (0, step, step, 32 * step, 0), loss=1.0, lr=[0.1],
                           memory=memory)
                prom.wait_for(f'offloop_step{{run="{run}"}}',
                              lambda r, step=step: r and float(r[0]["value"][1]) == step)
            for title, expr in gpu_panels:
                result = prom.api("query_range", query=_concrete(expr, run), start=started,
                                  end=time.time(), step="0.5")["result"]
                assert result, f"panel {title}: {expr} answered nothing from a stream with GPU memory"
                values = {float(v) for series in result for _, v in series["values"]}
                want = {float(memory[name.removeprefix("offloop_gpu_memory_")])
                        for name in _metric_names(expr) & GPU_ONLY}
                assert values == want, f"panel {title}: {expr} gave {values}, the stream carried {want}"
    finally:
        exporter.close(feed.state, feed.logger)
