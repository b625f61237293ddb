"""`PrometheusExporter`: serves the latest snapshot of a run on /metrics for Prometheus.

A custom collector renders, at scrape time, what this worker last received: named by
Prometheus conventions (base units, `_total` counters, labels `run` and `rank`). It
runs in a worker like any callback, so a slow scrape never touches the trainer.
"""

from __future__ import annotations

import os
import threading
from collections import deque

from offloop.bus import GRAD_NORMS, REFUSAL_KINDS
from offloop.workers.callback import Callback
from offloop.workers.callbacks.prometheus_targets import TargetFile, default_targets_dir
from offloop.workers.callbacks.speed_monitor import gpu_flops_available
from offloop.workers.scalars import as_float

__all__ = ["PrometheusExporter", "METRICS"]

#: every family the exporter serves: name -> (type, help). Counters are named without
#: `_total` here; the exposition adds it.
METRICS: dict[str, tuple[str, str]] = {
    "offloop_loss": ("gauge", "Training loss of the latest batch."),
    "offloop_learning_rate": ("gauge", "Learning rate of each optimizer parameter group."),
    "offloop_epoch": ("gauge", "Current epoch (completed epochs)."),
    "offloop_step": ("gauge", "Optimizer steps completed (Composer's batch counter)."),
    "offloop_samples": ("counter", "Training samples seen by this rank."),
    "offloop_tokens": ("counter", "Training tokens seen by this rank (when the trainer counts them)."),
    "offloop_samples_per_second": ("gauge", "This rank's training samples per second over the "
                                            "last window of batches, evaluation time excluded."),
    "offloop_tokens_per_second": ("gauge", "This rank's training tokens per second over the last "
                                           "window of batches, evaluation time excluded."),
    "offloop_flops_per_second": ("gauge", "This rank's model flops per second over the last window "
                                          "(when the model defines flops_per_batch)."),
    "offloop_mfu_ratio": ("gauge", "Model flops utilisation of this rank's device: flops per "
                                   "second over the device's peak (when both are known)."),
    "offloop_eval_metric": ("gauge", "Latest value of each evaluation metric, by dataloader "
                                     "label and metric name (the eval loss is metric=\"loss\")."),
    "offloop_train_metric": ("gauge", "Latest value of each scalar the training code logged with "
                                      "offloop.log_metrics(), by name."),
    "offloop_grad_norm": ("gauge", "Global L2 norm of the gradients of the latest batch."),
    "offloop_gpu_memory_allocated_bytes": ("gauge", "CUDA memory held by tensors "
                                                    "(torch.cuda.memory_allocated)."),
    "offloop_gpu_memory_reserved_bytes": ("gauge", "CUDA memory reserved by the caching allocator "
                                                   "(torch.cuda.memory_reserved)."),
    "offloop_gpu_memory_max_allocated_bytes": ("gauge", "Peak CUDA memory held by tensors "
                                                        "(torch.cuda.max_memory_allocated)."),
    "offloop_process_max_resident_memory_bytes": ("gauge", "Peak resident memory of the trainer "
                                                           "process (runs on the CPU)."),
    "offloop_events_received": ("counter", "Events this exporter's worker received from the trainer."),
    "offloop_events_lost": ("counter", "Events lost on the way to this worker (gaps in sequence "
                                       "numbers)."),
    "offloop_publisher_drops": ("counter", "Events the trainer dropped because its send queue was "
                                           "full (from its heartbeats)."),
    "offloop_refused": ("counter", "Messages the trainer's sockets refused from peers (malformed, "
                                   "oversized, unauthorised, ...), by kind (from its heartbeats)."),
    "offloop_control_requests": ("counter", "Halt and checkpoint requests the trainer read, by op."),
    "offloop_checkpoints_written": ("counter", "Checkpoints the trainer announced it wrote."),
    "offloop_run_info": ("gauge", "1, labelled with the run's model class and device (the run and "
                                  "rank label every series)."),
    "offloop_progress_ratio": ("gauge", "Fraction of max_duration trained (in fractional epochs where "
                                        "the epoch's length is known)."),
    "offloop_eta_seconds": ("gauge", "Training time left at the pace of the last window of batches, "
                                     "evaluations not counted."),
    "offloop_last_event_timestamp_seconds": ("gauge", "Unix time at which the trainer published the "
                                                      "latest event this exporter received (time() "
                                                      "minus it: how long the run has been silent)."),
}

#: batch_end `memory` keys -> family
_MEMORY = {
    "allocated_bytes": "offloop_gpu_memory_allocated_bytes",
    "reserved_bytes": "offloop_gpu_memory_reserved_bytes",
    "max_allocated_bytes": "offloop_gpu_memory_max_allocated_bytes",
    "max_rss_bytes": "offloop_process_max_resident_memory_bytes",
}


#: answers 200 while the exporter serves, without rendering the metrics (as Prometheus's own
#: /-/healthy): a container healthcheck polling /metrics would take the final scrape that
#: `linger` waits for away from Prometheus
HEALTH_PATH = "/-/healthy"


class _View:
    """What the collector renders: the latest values, updated by the worker thread."""

    def __init__(self) -> None:
        self.run, self.rank = "", "0"
        self.epoch = self.step = self.samples = self.tokens = 0
        self.loss: float | None = None
        self.grad_norm: float | None = None
        self.lr: tuple[float, ...] = ()
        self.memory: dict[str, float] = {}
        self.eval: dict[str, dict[str, float]] = {}
        self.train: dict[str, float] = {}  # log_metrics()'s
        self.samples_per_second: float | None = None
        self.tokens_per_second: float | None = None
        self.flops_per_second: float | None = None
        self.mfu: float | None = None
        self.events = self.gaps = self.checkpoints = 0
        self.drops: int | None = None
        self.refused: dict[str, int] = {}
        self.control: dict[str, int] = {}
        self.last_event_time: float | None = None
        self.model = self.device = ""
        self.progress: float | None = None
        self.eta: float | None = None
        self.finished = False


class PrometheusExporter(Callback):
    """Serve /metrics on `addr`:`port` from this worker, for Prometheus to scrape.

    Args:
        port: TCP port (0: any free port, printed when serving starts).
        addr: address to listen on; the default keeps it on this host, "0.0.0.0" lets
            a Prometheus elsewhere scrape it.
        window_size: batches over which samples/s, tokens/s, flops/s and MFU are measured.
        gpu_flops_available: peak flops of one device, for MFU; None looks it up from the
            run config's `device_name` and `precision` when the trainer publishes them.
        linger: after the run ends, keep serving until one more scrape has read the final
            values, for at most this many seconds (0: stop at once).
        targets_dir: where this exporter lists itself for Prometheus's file service
            discovery while it serves ("auto": $OFFLOOP_RUNS/prometheus-targets; None: not
            listed), so one scrape job finds every run on the host (docs/prometheus.md).

    The server starts at the first event this worker handles (never in the process that
    built the callback), and stops when the worker closes its callbacks. It asks the
    trainer for the gradients' norm (topic `grad_norms`) for `offloop_grad_norm`.
    """

    state_topics = frozenset({GRAD_NORMS})

    def __init__(self, port: int = 9464, addr: str = "127.0.0.1", *, window_size: int = 20,
                 gpu_flops_available: float | None = None, linger: float = 0.0,
                 targets_dir: str | os.PathLike | None = "auto") -> None:
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"PrometheusExporter: port must be an int in 0..65535, got {port!r}")
        if not isinstance(addr, str) or not addr:
            raise ValueError(f"PrometheusExporter: addr must be a host address, got {addr!r}")
        if isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 2:
            raise ValueError(f"PrometheusExporter: window_size must be an int >= 2, got {window_size!r}")
        if gpu_flops_available is not None and not as_float(gpu_flops_available):
            raise ValueError("PrometheusExporter: gpu_flops_available must be a number > 0, "
                             f"got {gpu_flops_available!r}")
        if as_float(linger) is None or linger < 0:
            raise ValueError(f"PrometheusExporter: linger must be seconds >= 0, got {linger!r}")
        if targets_dir is not None and not isinstance(targets_dir, (str, os.PathLike)):
            raise ValueError(f"PrometheusExporter: targets_dir must be a folder, 'auto' or None, got {targets_dir!r}")
        self.targets_dir = targets_dir
        self._target_file: TargetFile | None = None
        self.port, self.addr = port, addr
        self.window_size = window_size
        self.gpu_flops_available = gpu_flops_available
        self.linger = float(linger)
        # made in the worker, at the first event: a callback object must stay picklable
        self._lock: threading.Lock | None = None
        self._view: _View | None = None
        self._server = None
        self._final_scrape: threading.Event | None = None

    # ------------------------------------------------------------------ events

    def init(self, state, logger) -> None:
        self._seen(state)

    def fit_start(self, state, logger) -> None:
        self._start(state)
        self._peak_flops = self._device_peak(state)
        self._seen(state)

    def epoch_start(self, state, logger) -> None:
        self._seen(state)

    def epoch_end(self, state, logger) -> None:
        self._seen(state)

    def after_train_batch(self, state, logger) -> None:
        self._seen(state)

    def batch_end(self, state, logger) -> None:
        self._start(state)
        self._clock_batch(state)
        self._seen(state)

    def eval_start(self, state, logger) -> None:
        self._start(state)
        self._eval_started = state.wall_time
        self._seen(state)

    def eval_end(self, state, logger) -> None:
        self._start(state)
        if self._eval_started is not None:
            self._eval_seconds += max(0.0, state.wall_time - self._eval_started)
            self._eval_started = None
        self._seen(state)

    def checkpoint_saved(self, state, logger) -> None:
        self._seen(state, checkpoint=True)

    def control_request(self, state, logger) -> None:
        self._seen(state, control_op=str(state.data.get("op", "unknown")))

    def fit_end(self, state, logger) -> None:
        self._seen(state)
        with self._lock:
            self._view.finished = True

    def close(self, state, logger) -> None:
        if self._server is None:
            return
        with self._lock:
            self._view.finished = True
        if self.linger > 0:
            self._final_scrape.wait(self.linger)
        if self._target_file is not None:  # Prometheus drops the target at its next look
            self._target_file.remove()
        self._server.shutdown()
        self._server.server_close()
        self._server = None

    # --------------------------------------------------------------- updating

    def _start(self, state) -> None:
        """Serve at the first event: this is the worker process."""
        if self._lock is not None:
            return
        from prometheus_client.registry import CollectorRegistry

        self._lock, self._view, self._final_scrape = threading.Lock(), _View(), threading.Event()
        self._request = threading.local()  # what the scrape in this handler thread rendered
        self._window: deque[tuple[float, int, int, float | None]] = deque(maxlen=self.window_size)
        self._flops_seen: float | None = 0.0
        self._peak_flops = self._device_peak(state)  # a late joiner has the config, not fit_start
        self._eval_seconds, self._eval_started = 0.0, None
        self._eval_source = None
        self._train_source = None
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(self))
        self._app = self._wsgi_app(registry)
        self._server = _serve(self._app, self.addr, self.port)
        host, port = self._server.server_address[:2]
        print(f"PrometheusExporter: serving http://{host}:{port}/metrics", flush=True)
        if self.targets_dir is not None:
            folder = default_targets_dir() if self.targets_dir == "auto" else self.targets_dir
            self._target_file = TargetFile(folder, state.run_id or state.run_name, state.rank)
            try:
                self._target_file.write(self.addr, port, {})
            except OSError as exc:  # an unwritable folder costs the discovery, not the metrics
                print(f"PrometheusExporter: not listed for discovery in {folder}: {exc}", flush=True)
                self._target_file = None

    def _device_peak(self, state) -> float | None:
        if self.gpu_flops_available is not None:
            return float(self.gpu_flops_available)
        return gpu_flops_available(state.config.get("device_name"), state.config.get("precision"))

    def _clock_batch(self, state) -> None:
        """Throughput over the window, on the trainer's clock less time spent evaluating."""
        flops = as_float(state.flops)
        if flops is None:
            self._flops_seen = None
        elif self._flops_seen is not None:
            self._flops_seen += flops
        ts = state.timestamp
        self._window.append((state.wall_time - self._eval_seconds, ts.sample, ts.token, self._flops_seen,
                             _progress(state)))
        (t0, s0, k0, f0, p0), (t1, s1, k1, f1, p1) = self._window[0], self._window[-1]
        if t1 <= t0:  # a single batch in the window, or a clock that went back
            return
        rates = {"samples_per_second": (s1 - s0) / (t1 - t0),
                 "tokens_per_second": (k1 - k0) / (t1 - t0) if k1 > k0 else None,
                 "flops_per_second": None, "mfu": None,
                 "eta": (1 - p1) * (t1 - t0) / (p1 - p0) if p0 is not None and p1 is not None and p1 > p0 else None}
        if f0 is not None and f1 is not None:
            rates["flops_per_second"] = (f1 - f0) / (t1 - t0)
            if self._peak_flops:
                rates["mfu"] = rates["flops_per_second"] / self._peak_flops
        with self._lock:
            for name, value in rates.items():
                setattr(self._view, name, value)

    def _seen(self, state, *, checkpoint: bool = False, control_op: str | None = None) -> None:
        """Copy what the collector renders out of the State, under the lock."""
        self._start(state)
        ts = state.timestamp
        memory = {key: v for key, v in ((k, as_float(v)) for k, v in state.memory.items())
                  if v is not None}
        lr = tuple(v for v in (as_float(x) for x in state.lr) if v is not None)
        with self._lock:
            view = self._view
            view.run, view.rank = state.run_name, str(state.rank)
            view.model, view.device = str(state.config.get("model", "")), str(state.config.get("device", ""))
            view.progress = _progress(state)
            view.epoch, view.step, view.samples, view.tokens = ts.epoch, ts.batch, ts.sample, ts.token
            view.loss, view.grad_norm = as_float(state.loss), as_float(state.grad_norm)
            view.lr, view.memory = lr, memory
            if state.train_metrics is not self._train_source:  # replaced when a batch_end brings some
                self._train_source = state.train_metrics
                view.train = {n: v for n, v in
                              ((n, as_float(x)) for n, x in state.train_metrics.items())
                              if v is not None}
            if state.eval_metrics is not self._eval_source:  # the State replaces it at eval_end
                self._eval_source = state.eval_metrics
                view.eval = {label: {n: v for n, v in ((n, as_float(x)) for n, x in metrics.items())
                                     if v is not None}
                             for label, metrics in state.eval_metrics.items()}
            # the worker's counts cover every event it received, not only those handled here
            view.events = max(view.events + 1, state.events_received)
            view.gaps, view.drops = state.gaps, state.publisher_drops
            view.refused = state.publisher_refused  # a FrozenDict: replaced, never changed
            view.last_event_time = state.wall_time
            view.checkpoints += checkpoint
            if control_op is not None:
                view.control[control_op] = view.control.get(control_op, 0) + 1

    # -------------------------------------------------------------- rendering

    def _collect(self) -> list:
        """The metric families, rendered from the view at scrape time."""
        with self._lock:
            view = self._view
            families = _families(view)
            self._request.final = view.finished
        return families

    def _wsgi_app(self, registry):
        """prometheus_client's /metrics app; a scrape that rendered the final values ends
        the linger only once its response is written (the server closes the body after the
        last byte), so close() cannot cut the one scrape it waited for."""
        from prometheus_client import make_wsgi_app

        metrics = make_wsgi_app(registry)

        def app(environ, start_response):
            if environ.get("PATH_INFO") == HEALTH_PATH:  # not a scrape: the linger waits on for one
                start_response("200 OK", [("Content-Type", "text/plain")])
                return [b"OK\n"]
            self._request.final = False
            body = metrics(environ, start_response)
            return _Written(body, self._final_scrape.set if self._request.final else None)

        return app


class _Written:
    """A WSGI response body that calls `then` once the server has written all of it:
    PEP 3333 has the server call close() after the last byte, or on an error."""

    def __init__(self, body, then) -> None:
        self._body, self._then = body, then

    def __iter__(self):
        return iter(self._body)

    def __len__(self) -> int:  # lets the server set Content-Length for a one-block body
        return len(self._body)

    def close(self) -> None:
        try:
            if hasattr(self._body, "close"):
                self._body.close()
        finally:
            if self._then is not None:
                self._then()


def _serve(app, addr: str, port: int):
    """A threading WSGI server for `app` on addr:port, in a daemon thread (what
    prometheus_client's start_http_server does, with the app given)."""
    import socket
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from prometheus_client.exposition import ThreadingWSGIServer

    class Server(ThreadingWSGIServer):
        address_family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0][0]

    class Quiet(WSGIRequestHandler):
        def log_message(self, format, *args):  # noqa: A002 - the base class's signature
            pass

    server = make_server(addr, port, app, Server, handler_class=Quiet)
    threading.Thread(target=server.serve_forever, daemon=True, name="offloop-metrics").start()
    return server


class _Collector:
    """prometheus_client's custom-collector protocol over one exporter."""

    def __init__(self, exporter: PrometheusExporter) -> None:
        self._exporter = exporter

    def collect(self):
        yield from self._exporter._collect()


def _progress(state) -> float | None:
    """The fraction of max_duration trained; in epochs, counting the current one's batches
    where the epoch's length is known (state.get_elapsed_duration() counts whole epochs)."""
    duration, ts, length = state.max_duration, state.timestamp, state.dataloader_len
    if duration is None or duration.value <= 0:
        return None
    if duration.unit.value == "ep" and length:
        return min(1.0, (ts.epoch + ts.batch_in_epoch / length) / duration.value)
    return min(1.0, state.get_elapsed_duration())


def _families(view: _View) -> list:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    extra_labels = {"offloop_run_info": ["model", "device"],
                    "offloop_learning_rate": ["group"], "offloop_eval_metric": ["dataloader", "metric"],
                    "offloop_train_metric": ["metric"],
                    "offloop_control_requests": ["op"], "offloop_refused": ["what"]}
    families = {}
    for name, (kind, help_text) in METRICS.items():
        cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        families[name] = cls(name, help_text, labels=["run", "rank", *extra_labels.get(name, [])])
    if not view.run and view.last_event_time is None:
        return list(families.values())  # nothing received yet: the families, without samples
    labels = [view.run, view.rank]

    def put(name: str, value: float | None, *more: str) -> None:
        if value is not None:
            families[name].add_metric([*labels, *more], value)

    put("offloop_run_info", 1, view.model, view.device)
    put("offloop_progress_ratio", view.progress)
    put("offloop_eta_seconds", view.eta)
    put("offloop_loss", view.loss)
    for group, lr in enumerate(view.lr):
        put("offloop_learning_rate", lr, str(group))
    put("offloop_epoch", view.epoch)
    put("offloop_step", view.step)
    put("offloop_samples", view.samples)
    put("offloop_tokens", view.tokens)
    put("offloop_samples_per_second", view.samples_per_second)
    put("offloop_tokens_per_second", view.tokens_per_second)
    put("offloop_flops_per_second", view.flops_per_second)
    put("offloop_mfu_ratio", view.mfu)
    for label, metrics in sorted(view.eval.items()):
        for metric, value in sorted(metrics.items()):
            put("offloop_eval_metric", value, label, metric)
    for metric, value in sorted(view.train.items()):
        put("offloop_train_metric", value, metric)
    put("offloop_grad_norm", view.grad_norm)
    for key, value in view.memory.items():
        if key in _MEMORY:
            put(_MEMORY[key], value)
    put("offloop_events_received", view.events)
    put("offloop_events_lost", view.gaps)
    put("offloop_publisher_drops", view.drops)
    # every kind from the start, at 0: increase() sees a kind's first refusal
    for what, count in sorted({**dict.fromkeys(REFUSAL_KINDS, 0), **view.refused}.items()):
        put("offloop_refused", count, what)
    for op, count in sorted(view.control.items()):
        put("offloop_control_requests", count, op)
    put("offloop_checkpoints_written", view.checkpoints)
    if view.last_event_time is not None:
        put("offloop_last_event_timestamp_seconds", view.last_event_time)
    return list(families.values())
