"""`offloop attach <run>`: a live, read-only terminal monitor of a running job.

It joins through the late-join state, so the screen shows the run at once; it only
subscribes (no control client exists here); a slow job just means slower updates;
it exits when the run ends. Never imports torch: startup stays well under a second.
With no run named, it attaches to the one live run under the runs root, or asks which
when there are several (and, with no terminal to ask on, says which there are).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from offloop.errors import abort

TOPICS = ["init", "fit_start", "epoch_start", "batch_end", "epoch_end", "eval_end",
          "checkpoint_saved", "control_request", "fit_end"]
SPARK = "▁▂▃▄▅▆▇█"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", nargs="?",
                        help="run directory, run name (under --runs-root) or state endpoint tcp://host:port "
                             "(default: the live run under the runs root; asks which when there are several)")
    parser.add_argument("--runs-root", help="where run names are looked up (default $OFFLOOP_RUNS or ./runs)")
    parser.add_argument("--refresh", type=float, default=4.0, help="screen refreshes per second")
    parser.add_argument("--once", action="store_true", help="print the current state once and exit")
    parser.add_argument("--keys", default=os.environ.get("OFFLOOP_KEYS"),
                        help="keys folder (from `offloop keys`) for a run that has keys ($OFFLOOP_KEYS)")
    parser.add_argument("--key-name", default="client", help="which client key pair in --keys")
    parser.add_argument("--heartbeat-timeout", type=float, default=10.0,
                        help="seconds without a heartbeat before the run counts as gone")


@dataclass
class RunView:
    """Everything the screen shows, folded from the messages the monitor receives."""

    name: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    ts: tuple = (0, 0, 0, 0, 0)
    loss: float | None = None
    losses: deque = field(default_factory=lambda: deque(maxlen=48))
    lr: list = field(default_factory=list)
    eval_metrics: dict[str, dict[str, Any]] = field(default_factory=dict)
    checkpoints: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    checkpoint_count: int = 0  # the trainer's totals, which a late joiner cannot count itself
    request_count: int = 0
    started: float | None = None
    first_batch: tuple[float, int, int] | None = None  # (wall time, batch, sample) at the first batch_end seen
    last_batch: tuple[float, int, int] | None = None
    received: deque = field(default_factory=lambda: deque(maxlen=2000))
    events: int = 0
    status: str = "running"

    def take(self, msg) -> None:
        self.events += 1
        self.received.append(time.monotonic())
        self.ts = msg.ts
        data = msg.data
        if isinstance(data.get("config"), dict):
            self.config = data["config"]
            self.name = self.config.get("run_name", self.name)
        if msg.topic == "batch_end":
            self.loss = _number(data.get("loss"))
            if self.loss is not None:
                self.losses.append(self.loss)
            self.lr = list(data.get("lr") or [])
            point = (msg.t, msg.ts[1], msg.ts[3])
            self.first_batch = self.first_batch or point
            self.last_batch = point
        elif msg.topic == "eval_end":
            label = data.get("dataloader_label", "eval")
            self.eval_metrics[label] = {k: _number(v) for k, v in (data.get("metrics") or {}).items()}
        elif msg.topic == "checkpoint_saved":
            self.checkpoints.append(f"{data.get('path')} (batch {data.get('step')})")
            self.checkpoint_count = _total(data, self.checkpoint_count)
        elif msg.topic == "control_request":
            self.requests.append(f"{data.get('op')} from {data.get('client')} at batch {msg.ts[1]}")
            self.request_count = _total(data, self.request_count)
        elif msg.topic == "fit_end":
            stopped = data.get("stopped_by")
            self.status = f"finished (halted: {stopped.get('reason')})" if stopped else "finished"

    # ----------------------------------------------------------- derived

    def total_batches(self) -> int | None:
        duration = self.config.get("max_duration") or ""
        per_epoch = self.config.get("dataloader_len")
        if duration.endswith("ba"):
            return int(duration[:-2])
        if duration.endswith("ep") and per_epoch:
            return int(duration[:-2]) * per_epoch
        return None

    def rates(self) -> tuple[float | None, float | None]:
        """Batches/s and samples/s between the first and latest batch_end seen."""
        if not self.first_batch or not self.last_batch or self.last_batch[0] <= self.first_batch[0]:
            return None, None
        seconds = self.last_batch[0] - self.first_batch[0]
        return ((self.last_batch[1] - self.first_batch[1]) / seconds,
                (self.last_batch[2] - self.first_batch[2]) / seconds)

    def events_per_s(self) -> float:
        now = time.monotonic()
        recent = [t for t in self.received if now - t <= 5.0]
        return len(recent) / 5.0

    def eta(self) -> float | None:
        if self.status != "running":  # ended: nothing left to wait for
            return None
        total, (batches_per_s, _) = self.total_batches(), self.rates()
        if not total or not batches_per_s:
            return None
        return max(0.0, (total - self.ts[1]) / batches_per_s)


def _total(data: dict, counted: int) -> int:
    """The run's total so far, as the trainer numbers it; else one more than counted."""
    count = data.get("count")
    return count if isinstance(count, int) and not isinstance(count, bool) else counted + 1


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def sparkline(values) -> str:
    values = list(values)
    if not values:
        return ""
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int((v - low) / span * (len(SPARK) - 1)))] for v in values)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def render(view: RunView, sub_stats, publisher_drops: int):
    from rich.console import Group
    from rich.panel import Panel
    from rich.progress_bar import ProgressBar
    from rich.table import Table

    cfg = view.config
    head = Table.grid(padding=(0, 2))
    head.add_row("run", f"[bold]{view.name or '?'}[/]  [dim]{view.status}[/]")
    head.add_row("model", f"{cfg.get('model', '?')} ({cfg.get('num_params', '?')} params) on "
                          f"{cfg.get('device', '?')}, {cfg.get('precision', '?')}, world {cfg.get('world_size', '?')}")
    head.add_row("duration", f"{cfg.get('max_duration', '?')}, {cfg.get('dataloader_len', '?')} batches/epoch")
    total = view.total_batches()
    epoch, batch = view.ts[0], view.ts[1]
    progress = Table.grid(padding=(0, 2))
    done = f"epoch {epoch}  batch {batch}" + (f"/{total}" if total else "")
    bar = ProgressBar(total=total or 1, completed=min(batch, total or 1), width=40)
    progress.add_row(done, bar, f"ETA {_duration(view.eta())}" if view.status == "running" else "")
    metrics = Table.grid(padding=(0, 2))
    metrics.add_row("loss", f"{view.loss:.4f}" if view.loss is not None else "-", sparkline(view.losses))
    metrics.add_row("lr", ", ".join(f"{v:.3g}" for v in view.lr) or "-", "")
    for label, values in view.eval_metrics.items():
        shown = ", ".join(f"{k} {v:.4f}" for k, v in values.items() if v is not None)
        metrics.add_row(f"eval/{label}", shown or "-", "")
    batches_per_s, samples_per_s = view.rates()
    flow = Table.grid(padding=(0, 2))
    flow.add_row("throughput", f"{batches_per_s:.1f} batches/s, {samples_per_s:.0f} samples/s"
                 if batches_per_s else "-")
    flow.add_row("events", f"{view.events} received, {view.events_per_s():.1f}/s; "
                           f"lost {sub_stats.gaps}, publisher drops {publisher_drops}")
    flow.add_row("checkpoints", f"{view.checkpoint_count}" + (f", last {view.checkpoints[-1]}" if view.checkpoints else ""))
    flow.add_row("control", f"{view.request_count} requests" + (f", last: {view.requests[-1]}" if view.requests else ""))
    return Panel(Group(head, progress, metrics, flow), title="offloop attach", subtitle="read-only; Ctrl-C to leave")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    from offloop.bus import BusError, Subscriber, find_run
    from offloop.bus.security import client_keys_for, endpoint_keys

    try:
        if args.run is None:
            info = pick_live_run(args.runs_root)
        else:
            info = find_run(args.run, args.runs_root, curve=endpoint_keys(args.run, args.keys, args.key_name))
        curve = client_keys_for(info, args.keys, args.key_name)
    except BusError as exc:
        abort(str(exc), 1)
    if info.finished:
        abort(f"run {info.run_name} has finished; `offloop ls` shows how it ended", 1)
    view = RunView(name=info.run_name, config=dict(info.extra.get("config", {})))
    sub = Subscriber(info.endpoints["events"], info.endpoints.get("state"), topics=TOPICS,
                     heartbeat_timeout=args.heartbeat_timeout, curve=curve)
    try:
        joined = sub.connect(join_timeout=5)
    except BusError as exc:
        abort(f"cannot attach to run {info.run_name}: {exc}", 1)
    if joined is not None and joined.config:
        view.config = joined.config
    console = Console()
    if args.once:
        while (msg := sub.recv(timeout=0)) is not None:
            view.take(msg)
        # the late-join state holds one batch_end: listen up to a second for a second one,
        # so that throughput and ETA can be shown
        deadline = time.monotonic() + 1.0
        while view.last_batch == view.first_batch and (left := deadline - time.monotonic()) > 0:
            if (msg := sub.recv(timeout=left)) is None:
                break
            view.take(msg)
        console.print(render(view, sub.stats, sub.publisher_drops))
        sub.close()
        return 0
    code = 0
    period = 1.0 / max(args.refresh, 0.5)
    try:
        with Live(render(view, sub.stats, sub.publisher_drops), console=console,
                  refresh_per_second=args.refresh, screen=False) as live:
            try:
                while view.status == "running":
                    deadline = time.monotonic() + period
                    while (left := deadline - time.monotonic()) > 0:
                        msg = sub.recv(timeout=left)
                        if msg is None:
                            if sub.finished and view.status == "running":  # no fit_end came
                                view.status = "finished (stream closed)"
                            break
                        view.take(msg)
                    live.update(render(view, sub.stats, sub.publisher_drops))
            except BusError as exc:
                view.status = f"lost: {exc}"
                code = 3
            live.update(render(view, sub.stats, sub.publisher_drops))  # the last screen: no ETA
    except KeyboardInterrupt:
        code = 0
    finally:
        sub.close()
    console.print(f"offloop attach: run {view.name} {view.status}")
    return code


def pick_live_run(runs_root: str | None):
    """The one live run under the runs root; with several, the one the person picks (asked
    on the terminal), or, with no terminal to ask on, an error naming them all."""
    from offloop.bus import default_runs_root, list_runs
    from offloop.commands.ls import live_status
    from offloop.commands.shell import command

    root = os.path.abspath(runs_root or default_runs_root())
    live = [info for info in list_runs(root) if not info.finished and live_status(info) == "live"]
    root_args = ["--runs-root", root] if runs_root else []
    if not live:
        abort(f"no live run under {root} to attach to (`{command('ls', *root_args)}` lists every run; "
              "name one to attach to a run on another host)", 1)
    if len(live) == 1:
        return live[0]
    names = ", ".join(info.run_name for info in live)
    if not sys.stdin.isatty():
        # a run is named by its folder under the root (its run name, unless set apart)
        folder = os.path.basename(live[-1].run_dir) or live[-1].run_name
        abort(f"{len(live)} live runs under {root}: {names}; name the one to attach to, "
              f"e.g. `{command('attach', folder, *root_args)}`", 1)
    print(f"{len(live)} live runs under {root}:")
    for number, info in enumerate(live, 1):
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.started))
        print(f"  {number}. {info.run_name}  (started {started})")
    while True:
        try:
            answer = input(f"attach to which? [1-{len(live)}, or a name] ").strip()
        except EOFError:
            abort("no run chosen", 1)
        for number, info in enumerate(live, 1):
            if answer in (str(number), info.run_name, os.path.basename(info.run_dir)):
                return info
        print(f"  {answer!r} is none of them: type a number from 1 to {len(live)}, or a run's name")
