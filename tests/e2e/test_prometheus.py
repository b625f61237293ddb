"""PrometheusExporter: what /metrics serves, and a real Prometheus scraping a real run."""

from __future__ import annotations

import threading
import time
import urllib.error
import uuid
from pathlib import Path

import pytest
import torch
from helpers.exporter_feed import ExporterFeed
from helpers.prometheus_server import Prometheus, free_port, scrape, scrape_config
from prometheus_client.parser import text_string_to_metric_families
from torch import nn

from offloop.trainer import Trainer
from offloop.workers import Callback, CallbackRuntime
from offloop.workers.callbacks import PrometheusExporter
from offloop.workers.callbacks.prometheus import METRICS
from offloop.workers.state import FrozenDict


def _families(url: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(scrape(url))}


def _value(families: dict, name: str, **labels) -> float:
    family = families[name]
    found = [s.value for s in family.samples if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, f"{name}{labels}: {family.samples}"
    return found[0]


def test_metrics_follow_prometheus_conventions_and_render_the_latest_snapshot(free_port):
    exporter = PrometheusExporter(port=free_port)
    feed = ExporterFeed(exporter, "synthetic")
    url = f"http://127.0.0.1:{free_port}/metrics"
    t = time.time() - 10.0
    config = {"run_name": "synthetic", "device_name": "NVIDIA H100 80GB HBM3", "precision": "amp_bf16",
              "model": "Mlp", "device": "cuda:0", "max_duration": "10ba", "dataloader_len": 3}
    feed.event("init", t, (0, 0, 0, 0, 0), config=config)
    families = _families(url)  # every family is described from the first scrape on
    assert set(METRICS) <= set(families)
    assert {n: families[n].type for n in METRICS} == {n: kind for n, (kind, _) in METRICS.items()}

    memory = {"allocated_bytes": 1 << 30, "reserved_bytes": 2 << 30, "max_allocated_bytes": 3 << 30}
    feed.event("fit_start", t, (0, 0, 0, 0, 0), config=config)
    feed.event("batch_end", t + 1, (0, 1, 1, 32, 4096), loss=2.5, lr=[0.1, 0.01], memory=memory,
               flops=1e12)
    feed.event("grad_norms", t + 1.5, (0, 1, 1, 32, 4096), grad_norm=0.75)
    feed.event("after_train_batch", t + 1.5, (0, 1, 1, 32, 4096))
    feed.event("batch_end", t + 2, (0, 2, 2, 64, 8192), loss=2.25, lr=[0.1, 0.01], memory=memory,
               flops=1e12)
    feed.event("eval_start", t + 2.5, (0, 2, 2, 64, 8192), dataloader_label="eval")
    feed.event("eval_end", t + 4.5, (0, 2, 2, 64, 8192), dataloader_label="eval",
               metrics={"MulticlassAccuracy": 0.875, "loss": 0.5})
    feed.event("batch_end", t + 5, (0, 3, 3, 96, 12288), loss=2.0, lr=[0.05, 0.005], memory=memory,
               flops=1e12, metrics={"aux/penalty": 0.25, "aux/gate": 3})
    feed.event("control_request", t + 5, (0, 3, 3, 96, 12288), op="checkpoint", client="c", args={})
    feed.event("checkpoint_saved", t + 6, (0, 3, 3, 96, 12288), path="/x.pt", step=3, tag="",
               event="batch_checkpoint", requested_by="c")
    feed.event("control_request", t + 6, (0, 3, 3, 96, 12288), op="halt", client="c", args={})
    feed.writer.set(publisher_drops=4)  # as the worker runtime sets it from a heartbeat
    feed.writer.set(publisher_refused=FrozenDict({"control_malformed": 3, "events_foreign": 1}))
    feed.event("epoch_end", t + 7, (1, 3, 0, 96, 12288))

    families = _families(url)
    run = {"run": "synthetic", "rank": "0"}
    for family in families.values():  # few labels: run and rank, plus one naming a series' part
        for sample in family.samples:
            assert set(sample.labels) - {"run", "rank"} <= {"group", "dataloader", "metric", "op", "model",
                                                             "device", "what"}, sample
            assert {k: sample.labels[k] for k in run} == run, sample
    assert families["offloop_loss"].type == "gauge" and _value(families, "offloop_loss") == 2.0
    assert _value(families, "offloop_learning_rate", group="0") == 0.05
    assert _value(families, "offloop_learning_rate", group="1") == 0.005
    assert _value(families, "offloop_step") == 3 and _value(families, "offloop_epoch") == 1
    # what the training code logged with log_metrics(), by name
    assert _value(families, "offloop_train_metric", metric="aux/penalty") == 0.25
    assert _value(families, "offloop_train_metric", metric="aux/gate") == 3
    assert families["offloop_samples"].type == "counter"  # served as offloop_samples_total
    assert _value(families, "offloop_samples") == 96 and _value(families, "offloop_tokens") == 12288
    # the window's first batch ended at t+1, its last at t+5, with 2 s of evaluation between
    assert _value(families, "offloop_samples_per_second") == pytest.approx(64 / 2)
    assert _value(families, "offloop_tokens_per_second") == pytest.approx(8192 / 2)
    assert _value(families, "offloop_flops_per_second") == pytest.approx(2e12 / 2)
    assert _value(families, "offloop_mfu_ratio") == pytest.approx(1e12 / (1.979e15 / 2))
    assert _value(families, "offloop_eval_metric", dataloader="eval", metric="MulticlassAccuracy") == 0.875
    assert _value(families, "offloop_eval_metric", dataloader="eval", metric="loss") == 0.5
    assert _value(families, "offloop_grad_norm") == 0.75
    assert _value(families, "offloop_gpu_memory_allocated_bytes") == 1 << 30
    assert _value(families, "offloop_gpu_memory_reserved_bytes") == 2 << 30
    assert _value(families, "offloop_gpu_memory_max_allocated_bytes") == 3 << 30
    assert _value(families, "offloop_control_requests", op="checkpoint") == 1
    assert _value(families, "offloop_control_requests", op="halt") == 1
    assert _value(families, "offloop_checkpoints_written") == 1
    assert _value(families, "offloop_events_received") == 12
    assert _value(families, "offloop_events_lost") == 0
    assert _value(families, "offloop_publisher_drops") == 4  # read from the State, not the worker
    assert _value(families, "offloop_refused", what="control_malformed") == 3
    assert _value(families, "offloop_refused", what="events_foreign") == 1
    assert _value(families, "offloop_last_event_timestamp_seconds") == pytest.approx(t + 7)  # the epoch_end's
    assert _value(families, "offloop_run_info", model="Mlp", device="cuda:0") == 1
    assert _value(families, "offloop_progress_ratio") == pytest.approx(0.3)  # 3 of "10ba"
    # 0.1 of the run a second over the window (the 2 s evaluation left out): 0.7 left takes 7 s
    assert _value(families, "offloop_eta_seconds") == pytest.approx(7.0)
    text = scrape(url)
    assert "offloop_samples_total{" in text and "offloop_checkpoints_written_total{" in text

    feed.event("fit_end", t + 8, (1, 3, 0, 96, 12288), stopped_by=None, checkpoints=["/x.pt"])
    exporter.close(feed.state, feed.logger)
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        scrape(url, timeout=1)


def test_the_lingered_for_scrape_is_written_whole_before_close_returns(free_port):
    """close() with linger waits for a scrape of the final values, and ends the wait only
    once the server has written that response (its body closed): the worker process that
    exits right after close() can no longer cut the one scrape Prometheus needed."""
    exporter = PrometheusExporter(port=free_port, linger=10)
    feed = ExporterFeed(exporter, "lingering")
    t = time.time() - 5.0
    feed.event("init", t, (0, 0, 0, 0, 0), config={"run_name": "lingering"})
    feed.event("batch_end", t + 1, (0, 3, 3, 96, 0), loss=0.5, lr=[0.1], batch_size=32)
    environ = {"REQUEST_METHOD": "GET", "PATH_INFO": "/metrics", "QUERY_STRING": "", "wsgi.input": None}

    def render() -> tuple[bytes, object]:
        body = exporter._app(environ, lambda status, headers: None)
        return b"".join(body), body

    text, body = render()  # the run is not over: no scrape ends the linger
    body.close()
    assert b"offloop_step" in text and not exporter._final_scrape.is_set()
    feed.event("fit_end", t + 2, (0, 3, 3, 96, 0), stopped_by=None, checkpoints=[])
    health = {**environ, "PATH_INFO": "/-/healthy"}  # the compose healthcheck: no scrape
    body = exporter._app(health, lambda status, headers: None)
    assert b"".join(body) == b"OK\n"
    if hasattr(body, "close"):
        body.close()
    assert not exporter._final_scrape.is_set()
    text, body = render()  # the final values, rendered but not yet written out
    assert b"offloop_step" in text and not exporter._final_scrape.is_set()
    body.close()  # the server closes a body after its last byte
    assert exporter._final_scrape.is_set()

    closing = threading.Thread(target=exporter.close, args=(feed.state, feed.logger))
    started = time.monotonic()
    closing.start()
    closing.join(15)
    assert not closing.is_alive() and time.monotonic() - started < 5  # no second wait
    with pytest.raises(urllib.error.URLError):  # the server is gone
        scrape(f"http://127.0.0.1:{free_port}/metrics", timeout=2)


def test_every_metric_is_documented():
    docs = (Path(__file__).parent.parent.parent / "docs/prometheus.md").read_text()
    for name, (kind, _) in METRICS.items():
        assert f"`{name}_total`" in docs if kind == "counter" else f"`{name}`" in docs, name


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="port must be an int in 0..65535, got 70000"):
        PrometheusExporter(port=70000)
    with pytest.raises(ValueError, match="window_size"):
        PrometheusExporter(window_size=1)
    with pytest.raises(ValueError, match="linger must be seconds >= 0, got -1"):
        PrometheusExporter(linger=-1)


class _SlowBatches:
    """Batches that take a while, so Prometheus scrapes many moments of the run."""

    def __init__(self, n: int, delay: float) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        gen = torch.Generator().manual_seed(0)
        for _ in range(self.n):
            time.sleep(self.delay)
            x = torch.randn(8, 8, generator=gen)
            yield x, (x[:, 0] > 0).long()


class _Published(Callback):
    """Keeps every step and batch loss the trainer published (all topics)."""

    def __init__(self) -> None:
        self.steps: set[int] = set()
        self.losses: dict[int, float] = {}

    def run_event(self, event, state, logger) -> None:
        self.steps.add(state.timestamp.batch)
        if state.event == "batch_end":
            self.losses[state.timestamp.batch] = state.loss


def _send_junk_control_requests(run_dir: Path, count: int) -> None:
    """`count` control requests that are not msgpack, as a confused or hostile peer sends."""
    import zmq

    from offloop.bus import read_run_info

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    try:
        sock.connect(read_run_info(run_dir).endpoints["control"])
        for _ in range(count):
            sock.send(b"\xc1 not msgpack")
        for _ in range(count):  # each is answered with an error
            assert sock.poll(10_000), "a malformed control request went unanswered"
            sock.recv_multipart()
    finally:
        sock.close()
        ctx.term()


def test_a_real_prometheus_scrapes_the_exporter_during_a_real_training_run(tmp_path):
    port = free_port()
    run_name = f"prom-{uuid.uuid4().hex[:6]}"
    with Prometheus(tmp_path / "prometheus", scrape_config([f"127.0.0.1:{port}"])) as prom:
        trainer = Trainer(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)),
                          _SlowBatches(30, 0.05), "2ep", loss_fn=nn.functional.cross_entropy,
                          run_dir=tmp_path / "run", run_name=run_name, seed=5,
                          callbacks=[PrometheusExporter(port=port, linger=10)])
        published = _Published()
        worker = CallbackRuntime(str(tmp_path / "run"), [published], destinations=[],
                                 heartbeat_timeout=30)
        worker.connect()
        _send_junk_control_requests(tmp_path / "run", 3)  # refused: counted, exported
        codes: list[int] = []
        thread = threading.Thread(target=lambda: codes.append(worker.run()), daemon=True)
        thread.start()
        try:
            trainer.fit()
        finally:
            trainer.close()  # the exporter serves until a scrape has read the final values
            thread.join(timeout=30)
        assert codes == [0] and not trainer.workers.crashes, (codes, trainer.workers.crashes)
        final = trainer.timestamp.batch
        assert final == 60

        selector = f'{{job="offloop", run="{run_name}", rank="0"}}'
        # over a range: once the exporter has gone, an instant query sees the stale marker
        prom.wait_for(f"max_over_time(offloop_step{selector}[10m])",
                      lambda r: r and float(r[0]["value"][1]) == final)
        prom.wait_for(f"max_over_time(offloop_refused_total{{job=\"offloop\", run=\"{run_name}\", "
                      f"what=\"control_malformed\"}}[10m])",
                      lambda r: r and float(r[0]["value"][1]) == 3)
        steps = prom.samples(f"offloop_step{selector}")
        losses = prom.samples(f"offloop_loss{selector}")

    assert {v for _, v in steps} <= published.steps, "a scraped step the trainer never published"
    assert len({v for _, v in steps}) >= 3, f"too few scrapes during the run: {steps}"
    assert {v for _, v in losses} <= set(published.losses.values()), "a scraped loss never published"
    assert len({v for _, v in losses}) >= 3, f"too few distinct losses scraped: {losses}"
    assert losses[-1][1] == published.losses[final]  # the last scrape saw the final batch
