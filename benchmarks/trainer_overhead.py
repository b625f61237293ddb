"""Trainer benchmark: what publishing costs a training step, against a hand-written loop.

Two model sizes, CPU, one torch thread, SGD(lr=0.01) and cross_entropy, the same
in-memory batches (fixed seed) in every case of a size. The tiny MLP (64-64-10, batch 32,
~0.15 ms a step) shows the trainer's fixed cost at its largest; the large one
(784-512-512-10, batch 64, ~3 ms a step) is a model of real size, where the defaults must
cost nothing a user notices:

  (a) a hand-written PyTorch loop                                   -> plain_us
  (b) the Trainer with publishing off (publish=False)               -> bus_off_us
  (c) the Trainer with one worker process subscribed to every event -> bus_on_us
  (d) the Trainer with 4 worker processes, each 50 ms per batch_end -> heavy_workers_us
  (e) those 4 callbacks called in-process by the hand-written loop  -> inprocess_heavy_us
  (a), (b), (c) again with the large MLP -> plain_large_us, bus_off_large_us, bus_on_large_us

Per-step time is the median of per-step intervals: every case iterates the batches
through the same `Blocks` loader, which reads perf_counter_ns each time the next batch
is asked for, so one interval is one whole step as the loop sees it (for the Trainer:
its events, forward, loss, backward, optimizer step, control poll).

The cases take turns in short blocks (250 steps by default, about 70 ms here; 40 steps,
about 120 ms, for the large MLP): one block of each case, again and again. Each Trainer is
built once, with its workers, and trains each block with `fit(duration=...)` to 250
more batches; the first steps of every block are discarded as warm-up, and a short
pause between blocks lets a worker finish the events of the block before. A shared
machine's slow spells last seconds, so blocks this short see the same machine: the
ratios come from blocks run tens of milliseconds apart, and the script prints both the
ratio of the pooled medians and the median of per-block ratios. Trainer construction,
worker start-up and close() are outside the timed spans. Prints one JSON object per
case and, last, a summary object with the ratios c/a (`ratio_bus_on`), d/c
(`ratio_heavy`), and b/a and c/a for the large MLP (`ratio_bus_off_large`,
`ratio_bus_on_large`); each ratio as the median of per-block ratios (`_block_median`,
and the `_large` keys) and as the ratio of means over every timed step (`_mean`: what a
user pays, stalls included); progress goes to stderr.

Run: python benchmarks/trainer_overhead.py [--steps N] [--blocks N] [--heavy-steps N]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from offloop.trainer import Trainer
from offloop.workers.callback import Callback

SEED, LR = 1234, 0.01
#: name -> (layer widths, batch size)
SIZES = {"tiny": ((64, 64, 10), 32), "large": ((784, 512, 512, 10), 64)}
HEAVY_SLEEP = 0.05  # seconds each heavy callback spends per batch_end
HEAVY_WORKERS = 4


class EveryEvent(Callback):
    """Subscribes to every event (run_event overridden) and does nothing with them."""

    def run_event(self, event, state, logger) -> None:
        pass


class Heavy(Callback):
    """Spends 50 ms on every batch_end: a slow logger, a metric upload, a plot."""

    def batch_end(self, state, logger) -> None:
        time.sleep(HEAVY_SLEEP)


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


def make_batches(size: str, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    (width, *_, classes), batch = SIZES[size]
    gen = torch.Generator().manual_seed(SEED)
    return [(torch.randn(batch, width, generator=gen), torch.randint(0, classes, (batch,), generator=gen))
            for _ in range(n)]


def make_model(size: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(SEED)
    widths, _ = SIZES[size]
    layers: list[torch.nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(widths, widths[1:], strict=False)):
        layers += [torch.nn.ReLU()] if i else []
        layers.append(torch.nn.Linear(n_in, n_out))
    model = torch.nn.Sequential(*layers)
    return model, torch.optim.SGD(model.parameters(), lr=LR)


def summarize(case: str, blocks: list[list[float]], **extra) -> dict:
    """Median and spread of every timed step of a case, pooled over its blocks."""
    pooled = sorted(x for b in blocks for x in b)
    n = len(pooled)
    return {"case": case, "steps": n, "median_us": round(statistics.median(pooled), 2),
            "p10_us": round(pooled[n // 10], 2), "p90_us": round(pooled[int(n * 0.9)], 2),
            "mean_us": round(statistics.fmean(pooled), 2), "blocks": len(blocks), **extra}


class PlainLoop:
    """(a) and (e): the hand-written loop, calling each callback's batch_end in-process."""

    def __init__(self, size: str, batches: list, callbacks: list | None = None) -> None:
        self.model, self.opt = make_model(size)
        self.model.train()
        self.loader = Blocks(batches)
        self.callbacks = callbacks or []

    def run(self, steps: int, warmup: int) -> list[float]:
        model, opt, callbacks = self.model, self.opt, self.callbacks
        for x, y in self.loader.block(steps):
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            for callback in callbacks:
                callback.batch_end(None, None)
        return self.loader.last_block_us(warmup)

    def close(self) -> dict:
        return {}


class TrainerLoop:
    """(b), (c), (d): one Trainer, built once; each block is one more fit() of `steps` batches."""

    def __init__(self, size: str, batches: list, callbacks: list, publish: bool) -> None:
        model, opt = make_model(size)
        self.run_dir = tempfile.mkdtemp(prefix="offloop-bench-")
        self.loader = Blocks(batches)
        self.trainer = Trainer(model, self.loader, max_duration="1ba", loss_fn=F.cross_entropy,
                               optimizers=opt, run_dir=self.run_dir, callbacks=callbacks,
                               publish=publish, eval_dataloader=None, seed=SEED, worker_shutdown_timeout=5)
        self.trained = 0

    def run(self, steps: int, warmup: int) -> list[float]:
        self.trained += steps
        self.trainer.fit(duration=f"{self.trained}ba")
        return self.loader.last_block_us(warmup)

    def close(self) -> dict:
        trainer = self.trainer
        try:
            drops = trainer.publisher.drops if trainer.publisher is not None else 0
            trainer.close()
            reports = [w.report for w in trainer.workers.workers]
        finally:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        info = {"publisher_drops": drops}
        if any(reports):  # a worker's own count, sent with its last fit_end acknowledgement
            info["worker_events"] = sum(r.get("events", 0) for r in reports)
            info["worker_gaps"] = sum(r.get("gaps", 0) for r in reports)
        return info


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=250, help="steps per block of each tiny case")
    parser.add_argument("--large-steps", type=int, default=40, help="steps per block of each large case")
    parser.add_argument("--warmup", type=int, default=20, help="steps discarded first, per tiny block")
    parser.add_argument("--large-warmup", type=int, default=5, help="steps discarded first, per large block")
    parser.add_argument("--blocks", type=int, default=40, help="timed blocks per case, taking turns")
    parser.add_argument("--heavy-steps", type=int, default=20, help="timed steps for case (e)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tiny, large = make_batches("tiny", args.steps + 1), make_batches("large", args.large_steps + 1)

    loops = {
        "plain": PlainLoop("tiny", tiny),
        "bus_off": TrainerLoop("tiny", tiny, [], publish=False),
        "bus_on": TrainerLoop("tiny", tiny, [EveryEvent()], publish=True),
        "heavy_workers": TrainerLoop("tiny", tiny, [Heavy() for _ in range(HEAVY_WORKERS)], publish=True),
        "plain_large": PlainLoop("large", large),
        "bus_off_large": TrainerLoop("large", large, [], publish=False),
        "bus_on_large": TrainerLoop("large", large, [EveryEvent()], publish=True),
    }
    blocks: dict[str, list[list[float]]] = {case: [] for case in loops}
    for b in range(args.blocks + 1):  # block 0 of each case warms it up and is not kept
        for case, loop in loops.items():
            steps, warmup = ((args.large_steps, args.large_warmup) if case.endswith("_large")
                             else (args.steps, args.warmup))
            kept = loop.run(steps, warmup)
            if b:
                blocks[case].append(kept)
            time.sleep(0.02)  # a worker finishes the block's last burst before the next case runs
        if b and b % 10 == 0:
            print(f"block {b}/{args.blocks}: " + ", ".join(
                f"{case} {statistics.median(kept[-1]):.1f} us" for case, kept in blocks.items()),
                file=sys.stderr, flush=True)
    info = {case: loop.close() for case, loop in loops.items()}
    heavy_warmup = 2
    inprocess = PlainLoop("tiny", tiny, [Heavy() for _ in range(HEAVY_WORKERS)])
    blocks["inprocess_heavy"] = [inprocess.run(heavy_warmup + args.heavy_steps, heavy_warmup)]

    med, mean = {}, {}
    for case, kept in blocks.items():
        line = summarize(case, kept, **info.get(case, {}))
        med[case], mean[case] = line["median_us"], line["mean_us"]
        print(json.dumps(line), flush=True)

    def per_block(num: str, den: str) -> list[float]:
        return sorted(statistics.median(n) / statistics.median(d)
                      for n, d in zip(blocks[num], blocks[den], strict=True))

    def block_median(num: str, den: str) -> float:
        return round(statistics.median(per_block(num, den)), 3)

    def of_means(num: str, den: str) -> float:
        return round(mean[num] / mean[den], 3)

    bus_on_blocks = per_block("bus_on", "plain")
    print(json.dumps({
        **{f"{case}_us": med[case] for case in blocks},
        **{f"{case}_mean_us": mean[case] for case in blocks if case != "inprocess_heavy"},
        "ratio_bus_off": round(med["bus_off"] / med["plain"], 3),
        "ratio_bus_on": round(med["bus_on"] / med["plain"], 3),
        "ratio_heavy": round(med["heavy_workers"] / med["bus_on"], 3),
        "ratio_inprocess_heavy": round(med["inprocess_heavy"] / med["heavy_workers"], 1),
        # each block's cases ran milliseconds apart: the median of their ratios is the
        # figure a slow spell of the machine moves least; p10/p90 show the spread
        "ratio_bus_off_block_median": block_median("bus_off", "plain"),
        "ratio_bus_on_block_median": block_median("bus_on", "plain"),
        "ratio_heavy_block_median": block_median("heavy_workers", "bus_on"),
        "ratio_bus_on_block_p10_p90": [round(bus_on_blocks[len(bus_on_blocks) // 10], 3),
                                       round(bus_on_blocks[int(len(bus_on_blocks) * 0.9)], 3)],
        "ratio_bus_off_large": block_median("bus_off_large", "plain_large"),
        "ratio_bus_on_large": block_median("bus_on_large", "plain_large"),
        # what a user pays: every timed step, the occasional stall (a burst's send) included
        "ratio_bus_off_mean": of_means("bus_off", "plain"),
        "ratio_bus_on_mean": of_means("bus_on", "plain"),
        "ratio_heavy_mean": of_means("heavy_workers", "bus_on"),
        "ratio_bus_off_large_mean": of_means("bus_off_large", "plain_large"),
        "ratio_bus_on_large_mean": of_means("bus_on_large", "plain_large"),
        "steps_per_block": args.steps, "large_steps_per_block": args.large_steps, "blocks": args.blocks,
        "heavy_steps": args.heavy_steps, "torch": torch.__version__, "threads": torch.get_num_threads(),
    }))


if __name__ == "__main__":
    main()
