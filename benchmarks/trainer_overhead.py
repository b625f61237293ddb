"""Trainer benchmark: what publishing costs a training step, against a hand-written loop.

Two model sizes, CPU, one torch thread, SGD(lr=0.01) and cross_entropy, the same
in-memory batches (fixed seed) in every case of a size. The tiny MLP (64-64-10, batch 32,
~0.15 ms a step) shows the trainer's fixed cost at its largest; the large one
(784-512-512-10, batch 64, ~2-3 ms a step) is a model of real size, where the defaults must
cost nothing a user notices. Every Trainer runs with the product's defaults (burst
interval, queue bounds, worker niceness) unless its case name says otherwise:

  (a) a hand-written PyTorch loop                                     -> plain
  (b) the Trainer with publishing off (publish=False)                 -> bus_off
  (c) the Trainer with one worker process subscribed to every event   -> bus_on
  (d) 4 worker processes, each subscribed to every event and sleeping
      50 ms at every batch_end (I/O-bound: an upload, a slow logger)  -> heavy_sleep
  (e) one worker subscribed to every event that spends 20 ms of CPU
      (numpy) at every batch_end, at the default niceness and at 0    -> heavy_cpu, heavy_cpu_nice0
  (f) (d)'s 4 callbacks called in-process by the hand-written loop    -> inprocess_heavy
  (p) the floor of publishing: (a)'s loop publishing the events (c) publishes, the least
      any publisher of them must do (below)                       -> plain_publishing
  (a), (p), (b), (c) again with the large MLP
                           -> plain_large, plain_publishing_large, bus_off_large, bus_on_large
  (g) the large MLP clipping the gradient norm and averaging the weights every step: by
      hand in (a)'s loop, and as (c) with GradientClipping and EMA (the algorithms,
      run in the training process)                 -> plain_algorithms_large, algorithms_large

(p) is a floor measured in the same run: the hand-written loop publishing the 13 events
a step that (c) publishes, by the least a publisher of them can do. At each event, a
wall-clock stamp and an append of (topic, time, data), the data (c) carries (the loss
read once with .item(), batch_end's learning rates); once the burst interval (5 ms, the
product's default) has passed, one packb of what was held (ormsgpack, offloop's packer)
and one non-blocking send on a ZeroMQ PUB socket (tcp, loopback) to a subscriber process
that decodes every message. It leaves out what the design brief asks of offloop beyond
that (sequence numbers and the per-topic counts, heartbeats, the late-join state, a
bound in bytes, skipping events nobody wants), so (c) cannot reach it;
`floor_bus_on_*` adds (b)'s and (p)'s excess over (a): the least (c) could cost with
the Trainer's own loop as it is.

A step is the interval between two fetches of a batch: every case iterates the same
`Blocks` loader, which reads perf_counter_ns each time the next batch is asked for, so
one interval is one whole step as the loop sees it (for the Trainer: its events,
forward, loss, backward, optimizer step, control poll, and any burst it sends).

The headline of each ratio is the ratio of means over every timed step (`ratio_*_mean`):
what a user pays in total, a burst's occasional stall included. Beside it, for each
ratio: the ratio of pooled medians (`_median`), of pooled 90th percentiles (`_p90`) and
the median of per-block ratios (`_block_median`, the figure a slow spell of the machine
moves least). The heavy workers fall behind by design: their gaps (events they never
saw, counted by sequence number) and how far behind they were as each block ended are
reported with each case.

The cases take turns in short blocks (250 steps by default, about 70 ms here; 40 steps,
about 100 ms, for the large MLP): one block of each case, again and again, so every
ratio compares blocks run tens of milliseconds apart. The order turns round every other
round (a, b, c, ... then ..., c, b, a), so no case always runs after the same one and
inherits what that one leaves behind (a worker still decoding, a colder cache). Each
Trainer of (b) and (c) is built once, with its worker, and trains each block with
`fit(duration=...)` to 250 more batches; (d) and (e) get a fresh Trainer and workers for
every block, ended after it, because their workers stay busy with a backlog and would
otherwise load the machine while the other cases run (they did: c/a on the large MLP read
1.09 instead of 1.05). The first steps of every block are discarded as warm-up, and a short pause between blocks
lets a worker finish the events of the block before. Trainer construction, worker
start-up and close() are outside the timed spans.

With --device cuda every case trains on the GPU (the hand-written loop too), steps run
asynchronously within a block, and the GPU is drained between blocks. Without it: no GPU
(no device copies, no CUDA staging). What it does not show either way: a machine with spare
cores (here the workers share two cores with the training thread and its publisher
threads, so (c)-(e) include that contention); data loading; more than one rank.

Prints one JSON object per case and, last, a summary object; progress goes to stderr.

Run: python benchmarks/trainer_overhead.py [--steps N] [--blocks N] [--heavy-steps N] [--device cuda]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import ormsgpack
import torch
import torch.nn.functional as F
import zmq

from offloop.algorithms import EMA, GradientClipping
from offloop.trainer import Trainer
from offloop.workers.callback import Callback

SEED, LR = 1234, 0.01
#: name -> (layer widths, batch size)
SIZES = {"tiny": ((64, 64, 10), 32), "large": ((784, 512, 512, 10), 64)}
HEAVY_SLEEP = 0.05  # seconds each sleeping callback spends per batch_end
HEAVY_WORKERS = 4
HEAVY_CPU = 0.02  # seconds of CPU the CPU-bound callback spends per batch_end
CLIP_NORM, EMA_SMOOTHING = 1.0, 0.99  # (g): GradientClipping('norm', 1.0) and EMA(smoothing=0.99)


class EveryEvent(Callback):
    """Subscribes to every event (run_event overridden) and does nothing with them."""

    def run_event(self, event, state, logger) -> None:
        pass


class Heavy(Callback):
    """Subscribes to every event and sleeps 50 ms at each batch_end: a slow logger, a
    metric upload (I/O-bound: it leaves the CPU to others while it waits). After each
    batch_end it writes what it has seen to `report_path` (it falls behind by design and
    never reaches fit_end's report before the benchmark ends)."""

    def __init__(self, report_path: str | None = None) -> None:
        self.report_path = report_path

    def run_event(self, event, state, logger) -> None:
        if event == "batch_end":
            self.work()
            if self.report_path:
                with open(self.report_path + ".tmp", "w") as out:
                    json.dump({"events": state.events_received, "gaps": state.gaps,
                               "batch": state.timestamp.batch}, out)
                os.replace(self.report_path + ".tmp", self.report_path)

    def work(self) -> None:
        time.sleep(HEAVY_SLEEP)


class HeavyCPU(Heavy):
    """Heavy, but spending 20 ms of its own CPU time in numpy at each batch_end: a metric
    computed from the snapshot, a plot rendered (CPU-bound)."""

    def work(self) -> None:
        x = np.linspace(0.0, 1.0, 4096)
        end = time.thread_time() + HEAVY_CPU
        while time.thread_time() < end:
            x = np.sin(x) + 0.5


class Blocks:
    """The batches, endlessly, with perf_counter_ns read each time a loop asks for the next
    one; each pass (one `iter()`, or one `block()`) keeps its own stamps."""

    def __init__(self, batches: list) -> None:
        self.batches = batches
        self.stamps: list[list[int]] = []

    def __len__(self) -> int:  # an epoch longer than any run here: fit() never ends one
        return 1 << 40

    def __iter__(self):
        """For the Trainer: it stops at its max_duration without asking for more."""
        clock, batches, stamps = time.perf_counter_ns, self.batches, []
        self.stamps.append(stamps)
        i = 0
        while True:
            stamps.append(clock())
            yield batches[i % len(batches)]
            i += 1

    def block(self, steps: int):
        """For the hand-written loop: `steps` batches, then one more stamp at the end."""
        clock, batches, stamps = time.perf_counter_ns, self.batches, []
        self.stamps.append(stamps)
        for i in range(steps):
            stamps.append(clock())
            yield batches[i % len(batches)]
        stamps.append(clock())

    def last_block_us(self, warmup: int) -> list[float]:
        """Intervals between consecutive fetches of the last pass after its warm-up steps, in µs."""
        s = self.stamps[-1]
        return [(s[i + 1] - s[i]) / 1000 for i in range(warmup, len(s) - 1)]


#: where every case trains (--device); the hand-written loop and the Trainer alike
DEVICE = torch.device("cpu")


def make_batches(size: str, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    (width, *_, classes), batch = SIZES[size]
    gen = torch.Generator().manual_seed(SEED)
    return [(torch.randn(batch, width, generator=gen).to(DEVICE),
             torch.randint(0, classes, (batch,), generator=gen).to(DEVICE)) for _ in range(n)]


def make_model(size: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(SEED)
    widths, _ = SIZES[size]
    layers: list[torch.nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(widths, widths[1:], strict=False)):
        layers += [torch.nn.ReLU()] if i else []
        layers.append(torch.nn.Linear(n_in, n_out))
    model = torch.nn.Sequential(*layers).to(DEVICE)
    return model, torch.optim.SGD(model.parameters(), lr=LR)


def summarize(case: str, blocks: list[list[float]], **extra) -> dict:
    """Median and spread of every timed step of a case, pooled over its blocks."""
    pooled = sorted(x for b in blocks for x in b)
    n = len(pooled)
    return {"case": case, "steps": n, "median_us": round(statistics.median(pooled), 2),
            "p10_us": round(pooled[n // 10], 2), "p90_us": round(pooled[int(n * 0.9)], 2),
            "mean_us": round(statistics.fmean(pooled), 2), "blocks": len(blocks), **extra}


class PlainLoop:
    """(a) and (f): the hand-written loop, calling each callback's batch_end in-process;
    with `algorithms`, clipping the gradient norm and averaging the weights by hand (g)."""

    def __init__(self, size: str, batches: list, callbacks: list | None = None, algorithms: bool = False) -> None:
        self.model, self.opt = make_model(size)
        self.model.train()
        self.loader = Blocks(batches)
        self.callbacks = callbacks or []
        self.average = [p.detach().clone() for p in self.model.parameters()] if algorithms else None

    def run(self, steps: int, warmup: int) -> list[float]:
        model, opt, callbacks, average = self.model, self.opt, self.callbacks, self.average
        params = list(model.parameters())
        for x, y in self.loader.block(steps):
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            if average is not None:
                torch.nn.utils.clip_grad_norm_(params, CLIP_NORM)
            opt.step()
            if average is not None:
                with torch.no_grad():
                    for a, p in zip(average, params, strict=True):
                        a.mul_(EMA_SMOOTHING).add_(p, alpha=1 - EMA_SMOOTHING)
            for callback in callbacks:
                callback.work()
        return self.loader.last_block_us(warmup)

    def close(self) -> dict:
        return {}


#: (p)'s subscriber process: decodes every message until it is killed
FLOOR_SUBSCRIBER = """
import sys, ormsgpack, zmq
sock = zmq.Context().socket(zmq.SUB)
sock.connect(sys.argv[1])
sock.subscribe(b"")
while True:
    ormsgpack.unpackb(sock.recv())
"""
FLOOR_INTERVAL = inspect.signature(Trainer).parameters["burst_interval"].default  # the product's default


class PublishingLoop(PlainLoop):
    """(p): (a)'s loop publishing (c)'s events of a step the cheapest way (module docstring)."""

    def __init__(self, size: str, batches: list) -> None:
        super().__init__(size, batches)
        self.batch_size = SIZES[size][1]
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.XPUB)  # XPUB: its subscriber's arrival can be awaited
        self.sock.sndhwm, self.sock.linger = 10_000, 0
        self.sock.bind("tcp://127.0.0.1:*")
        self.subscriber = subprocess.Popen([sys.executable, "-c", FLOOR_SUBSCRIBER,
                                            self.sock.last_endpoint.decode()])
        if not self.sock.poll(30_000):
            self.subscriber.kill()
            raise RuntimeError("the floor's subscriber process did not subscribe within 30 s")
        self.sock.recv()  # its subscription: from here every message reaches it

    def run(self, steps: int, warmup: int) -> list[float]:
        model, opt, size, groups = self.model, self.opt, self.batch_size, self.opt.param_groups
        held: list[tuple] = []
        hold, clock, pack, send = held.append, time.time, ormsgpack.packb, self.sock.send
        released = time.perf_counter()
        for x, y in self.loader.block(steps):
            hold(("after_dataloader", clock(), None))
            hold(("batch_start", clock(), {"batch_size": size}))
            hold(("before_train_batch", clock(), {"batch_size": size, "microbatches": 1}))
            opt.zero_grad(set_to_none=True)
            hold(("before_forward", clock(), None))
            outputs = model(x)
            hold(("after_forward", clock(), None))
            hold(("before_loss", clock(), None))
            loss = F.cross_entropy(outputs, y)
            value = loss.item()
            hold(("after_loss", clock(), {"loss": value}))
            hold(("before_backward", clock(), None))
            loss.backward()
            hold(("after_backward", clock(), None))
            hold(("after_train_batch", clock(), {"loss": value}))
            opt.step()
            hold(("batch_end", clock(), {"loss": value, "lr": [g["lr"] for g in groups], "batch_size": size}))
            hold(("batch_checkpoint", clock(), None))
            now = time.perf_counter()
            if now - released >= FLOOR_INTERVAL:
                send(pack(held), zmq.NOBLOCK)
                held.clear()
                released = now
            hold(("before_dataloader", clock(), None))
        if held:
            send(pack(held), zmq.NOBLOCK)
        return self.loader.last_block_us(warmup)

    def close(self) -> dict:
        self.subscriber.kill()
        self.subscriber.wait()
        self.sock.close()
        self.context.term()
        return {}


class TrainerLoop:
    """(b)-(e): one Trainer, built once; each block is one more fit() of `steps` batches.
    `heavy` (a Heavy class) and `workers` make the heavy cases' callbacks, each reporting
    to a file of its own in the run directory."""

    def __init__(self, size: str, batches: list, callbacks: list, publish: bool, *,
                 heavy: type[Heavy] | None = None, workers: int = 0, shutdown_timeout: float = 5,
                 **trainer_args) -> None:
        model, opt = make_model(size)
        self.run_dir = tempfile.mkdtemp(prefix="offloop-bench-")
        self.reports = [os.path.join(self.run_dir, f"heavy-{i}.json") for i in range(workers)]
        # each heavy callback in a process of its own (by default they would share one)
        callbacks = callbacks + [heavy(path).in_own_process() for path in self.reports] if heavy else callbacks
        self.loader = Blocks(batches)
        self.trainer = Trainer(model, self.loader, max_duration="1ba", loss_fn=F.cross_entropy,
                               optimizers=opt, run_dir=self.run_dir, callbacks=callbacks, device=DEVICE,
                               publish=publish, eval_dataloader=None, seed=SEED,
                               worker_shutdown_timeout=shutdown_timeout, **trainer_args)
        self.trained = 0

    def heavy_reports(self) -> dict:
        """What the heavy callbacks had seen when the last block ended: events, gaps, and
        how many batches behind the trainer they were."""
        seen = []
        for path in self.reports:
            try:
                with open(path) as f:
                    seen.append(json.load(f))
            except (OSError, ValueError):
                seen.append({"events": 0, "gaps": 0, "batch": 0})
        return {"heavy_events_seen": sum(r["events"] for r in seen),
                "heavy_gaps": sum(r["gaps"] for r in seen),
                "heavy_batches_behind": [self.trained - r["batch"] for r in seen]} if seen else {}

    def run(self, steps: int, warmup: int) -> list[float]:
        self.trained += steps
        self.trainer.fit(duration=f"{self.trained}ba")
        return self.loader.last_block_us(warmup)

    def close(self) -> dict:
        trainer = self.trainer
        try:
            drops = trainer.publisher.stats.drops if trainer.publisher is not None else 0
            trainer.close()
            reports = [w.report for w in trainer.workers.workers]
        finally:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        info = {"publisher_drops": drops}
        if trainer.algorithm_seconds:  # each algorithm's own time a step (warm-up steps included)
            info["algorithm_us_per_step"] = {name: round(seconds * 1e6 / self.trained, 1)
                                             for name, seconds in trainer.algorithm_seconds.items()}
        if any(reports):  # a worker's own count, sent with its last fit_end acknowledgement
            info["worker_events"] = sum(r.get("events", 0) for r in reports)
            info["worker_gaps"] = sum(r.get("gaps", 0) for r in reports)
        return info


class HeavyLoop:
    """(d), (e): a fresh Trainer with its heavy workers for every block, closed after it
    (outside the timed span). Heavy workers fall behind by design and stay busy with their
    backlog: kept alive between blocks, they would load the machine while every other case
    runs, and slow the denominators of the very ratios they are compared with."""

    def __init__(self, size: str, batches: list, heavy: type[Heavy], workers: int, **trainer_args) -> None:
        self.args = (size, batches, heavy, workers, trainer_args)
        self.seen: list[dict] = []
        self.drops = 0

    def run(self, steps: int, warmup: int) -> list[float]:
        size, batches, heavy, workers, trainer_args = self.args
        loop = TrainerLoop(size, batches, [], True, heavy=heavy, workers=workers, shutdown_timeout=0.5,
                           **trainer_args)
        try:
            kept = loop.run(steps, warmup)
            self.seen.append(loop.heavy_reports())
        finally:
            self.drops += loop.close()["publisher_drops"]
        return kept

    def close(self) -> dict:
        """What the heavy callbacks had seen as each block ended, over every block."""
        return {"publisher_drops": self.drops,
                "heavy_events_seen": sum(r["heavy_events_seen"] for r in self.seen),
                "heavy_gaps": sum(r["heavy_gaps"] for r in self.seen),
                "heavy_batches_behind_per_block": round(statistics.fmean(
                    statistics.fmean(r["heavy_batches_behind"]) for r in self.seen), 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=250, help="steps per block of each tiny case")
    parser.add_argument("--large-steps", type=int, default=40, help="steps per block of each large case")
    parser.add_argument("--warmup", type=int, default=20, help="steps discarded first, per tiny block")
    parser.add_argument("--large-warmup", type=int, default=5, help="steps discarded first, per large block")
    parser.add_argument("--blocks", type=int, default=40, help="timed blocks per case, taking turns")
    parser.add_argument("--heavy-steps", type=int, default=20, help="timed steps for case (f)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda: where every case trains")
    args = parser.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    torch.set_num_threads(1)
    tiny, large = make_batches("tiny", args.steps + 1), make_batches("large", args.large_steps + 1)

    loops = {
        "plain": PlainLoop("tiny", tiny),
        "plain_publishing": PublishingLoop("tiny", tiny),
        "bus_off": TrainerLoop("tiny", tiny, [], publish=False),
        "bus_on": TrainerLoop("tiny", tiny, [EveryEvent()], publish=True),
        "heavy_sleep": HeavyLoop("tiny", tiny, Heavy, HEAVY_WORKERS),
        "heavy_cpu": HeavyLoop("tiny", tiny, HeavyCPU, 1),
        "heavy_cpu_nice0": HeavyLoop("tiny", tiny, HeavyCPU, 1, worker_nice=0),
        "plain_large": PlainLoop("large", large),
        "plain_publishing_large": PublishingLoop("large", large),
        "bus_off_large": TrainerLoop("large", large, [], publish=False),
        "bus_on_large": TrainerLoop("large", large, [EveryEvent()], publish=True),
        "plain_algorithms_large": PlainLoop("large", large, algorithms=True),
        "algorithms_large": TrainerLoop("large", large, [EveryEvent()], publish=True, algorithms=[
            GradientClipping("norm", CLIP_NORM), EMA(half_life=None, smoothing=EMA_SMOOTHING)]),
    }
    blocks: dict[str, list[list[float]]] = {case: [] for case in loops}
    for b in range(args.blocks + 1):  # block 0 of each case warms it up and is not kept
        for case, loop in (loops.items() if b % 2 == 0 else reversed(loops.items())):
            steps, warmup = ((args.large_steps, args.large_warmup) if case.endswith("_large")
                             else (args.steps, args.warmup))
            kept = loop.run(steps, warmup)
            if b:
                blocks[case].append(kept)
            if DEVICE.type == "cuda":  # the next case never waits on this one's queued kernels
                torch.cuda.synchronize()
            time.sleep(0.02)  # a worker finishes the block's last burst before the next case runs
        if b and b % 10 == 0:
            print(f"block {b}/{args.blocks}: " + ", ".join(
                f"{case} {statistics.fmean(kept[-1]):.1f} us" for case, kept in blocks.items()),
                file=sys.stderr, flush=True)
    info = {case: loop.close() for case, loop in loops.items()}
    heavy_warmup = 2
    inprocess = PlainLoop("tiny", tiny, [Heavy() for _ in range(HEAVY_WORKERS)])
    blocks["inprocess_heavy"] = [inprocess.run(heavy_warmup + args.heavy_steps, heavy_warmup)]

    lines = {case: summarize(case, kept, **info.get(case, {})) for case, kept in blocks.items()}
    for line in lines.values():
        print(json.dumps(line), flush=True)
    summary: dict = {f"{case}_mean_us": line["mean_us"] for case, line in lines.items()}
    summary |= {f"{case}_us": line["median_us"] for case, line in lines.items()}
    for name, (num, den) in RATIOS.items():
        summary |= ratios(name, blocks[num], blocks[den], lines[num], lines[den])
    # issue 19's names for the large model's figures: the median of per-block ratios
    summary["ratio_bus_off_large"] = summary["ratio_bus_off_large_block_median"]
    summary["ratio_bus_on_large"] = summary["ratio_bus_on_large_block_median"]
    for size in ("", "_large"):  # the least (c) could cost: (b)'s excess and (p)'s together
        for kind in ("mean", "block_median"):
            summary[f"floor_bus_on{size}_{kind}"] = round(
                summary[f"ratio_bus_off{size}_{kind}"] + summary[f"ratio_floor{size}_{kind}"] - 1, 3)
    summary["ratio_inprocess_heavy_mean"] = round(lines["inprocess_heavy"]["mean_us"]
                                                  / lines["heavy_sleep"]["mean_us"], 1)
    summary["targets"] = {key: {"target": target, "met": summary[key] <= target}
                          for key, target in TARGETS.items()}
    summary |= {"steps_per_block": args.steps, "large_steps_per_block": args.large_steps,
                "blocks": args.blocks, "heavy_steps": args.heavy_steps, "torch": torch.__version__,
                "device": torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else "cpu",
                "threads": torch.get_num_threads()}
    print(json.dumps(summary))


#: ratio name -> (numerator case, denominator case)
RATIOS = {
    "floor": ("plain_publishing", "plain"),
    "bus_off": ("bus_off", "plain"),
    "bus_on": ("bus_on", "plain"),
    "heavy_sleep": ("heavy_sleep", "bus_on"),
    "heavy_cpu": ("heavy_cpu", "bus_on"),
    "heavy_cpu_nice0": ("heavy_cpu_nice0", "bus_on"),
    "floor_large": ("plain_publishing_large", "plain_large"),
    "bus_off_large": ("bus_off_large", "plain_large"),
    "bus_on_large": ("bus_on_large", "plain_large"),
    "algorithms_large": ("algorithms_large", "plain_algorithms_large"),
}
#: the issue's targets, each on the ratio of means (what a user pays)
TARGETS = {"ratio_bus_on_mean": 1.15, "ratio_bus_on_large_mean": 1.03, "ratio_heavy_sleep_mean": 1.05}


def ratios(name: str, num: list[list[float]], den: list[list[float]], num_line: dict, den_line: dict) -> dict:
    """One ratio four ways: of means (the headline: total time), of pooled medians and 90th
    percentiles, and the median of per-block ratios (blocks run milliseconds apart)."""
    per_block = sorted(statistics.median(n) / statistics.median(d) for n, d in zip(num, den, strict=True))
    return {
        f"ratio_{name}_mean": round(num_line["mean_us"] / den_line["mean_us"], 3),
        f"ratio_{name}_median": round(num_line["median_us"] / den_line["median_us"], 3),
        f"ratio_{name}_p90": round(num_line["p90_us"] / den_line["p90_us"], 3),
        f"ratio_{name}_block_median": round(statistics.median(per_block), 3),
    }


if __name__ == "__main__":
    main()
