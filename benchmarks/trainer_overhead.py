"""Trainer benchmark: what publishing costs a training step, against a hand-written loop.

One tiny MLP (Linear(64,64), ReLU, Linear(64,10)), batch 32, CPU, one torch thread,
SGD(lr=0.01) and cross_entropy, the same in-memory batches (fixed seed) in every case:

  (a) a hand-written PyTorch loop                                   -> plain_us
  (b) the Trainer with publishing off (publish=False)               -> bus_off_us
  (c) the Trainer with one worker process subscribed to every event -> bus_on_us
  (d) the Trainer with 4 worker processes, each 50 ms per batch_end -> heavy_workers_us
  (e) those 4 callbacks called in-process by the hand-written loop  -> inprocess_heavy_us

Per-step time is the median of per-step intervals: every case iterates the batches
through the same `Stamped` wrapper, which reads perf_counter_ns each time the next
batch is asked for, so one interval is one whole step as the loop sees it (for the
Trainer: its events, forward, loss, backward, optimizer step, control poll). The first
steps of each case are discarded as warm-up; trainer construction, worker start-up
and close() are outside the timed span. Cases (a)-(d) take turns for several rounds
(a fresh model, Trainer and workers each time) and each figure pools its rounds, so a
slow spell of a shared machine does not land on one case only. Prints one JSON object
per case and, last, a summary object with the ratios c/a (`ratio_bus_on`) and d/c
(`ratio_heavy`); progress goes to stderr.

Run: python benchmarks/trainer_overhead.py [--steps N] [--rounds N] [--heavy-steps N]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

# This folder holds bus.py, named like the `bus` package the trainer imports: keep the
# folder off the import path (spawned worker processes inherit this sys.path).
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent.resolve()]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from trainer import Trainer  # noqa: E402
from workers.callback import Callback  # noqa: E402

BATCH, SEED, LR = 32, 1234, 0.01
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


class Stamped:
    """The batches, with perf_counter_ns read each time the loop asks for the next one."""

    def __init__(self, batches: list) -> None:
        self.batches = batches
        self.stamps: list[int] = []

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        clock, stamps = time.perf_counter_ns, self.stamps
        for batch in self.batches:
            stamps.append(clock())
            yield batch
        stamps.append(clock())

    def step_us(self, warmup: int) -> list[float]:
        """Intervals between consecutive fetches after the warm-up steps, in µs: one per
        batch but the last (the Trainer stops at max_duration without asking for more)."""
        s = self.stamps
        return [(s[i + 1] - s[i]) / 1000 for i in range(warmup, len(self.batches) - 1)]


def make_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(SEED)
    return [(torch.randn(BATCH, 64, generator=gen), torch.randint(0, 10, (BATCH,), generator=gen))
            for _ in range(n)]


def make_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(SEED)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    return model, torch.optim.SGD(model.parameters(), lr=LR)


def summarize(case: str, rounds: list[list[float]], **extra) -> dict:
    """Median and spread of every timed step of a case, pooled over the rounds."""
    pooled = sorted(x for r in rounds for x in r)
    n = len(pooled)
    return {"case": case, "steps": n, "median_us": round(statistics.median(pooled), 2),
            "p10_us": round(pooled[n // 10], 2), "p90_us": round(pooled[int(n * 0.9)], 2),
            "mean_us": round(statistics.fmean(pooled), 2),
            "round_medians_us": [round(statistics.median(r), 2) for r in rounds], **extra}


def plain_loop(batches: list, warmup: int, callbacks: list | None = None) -> list[float]:
    """(a) and (e): the hand-written loop, calling each callback's batch_end in-process."""
    model, opt = make_model()
    model.train()
    loader = Stamped(batches)
    for x, y in loader:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        for callback in callbacks or ():
            callback.batch_end(None, None)
    return loader.step_us(warmup)


def trainer_loop(batches: list, warmup: int, callbacks: list, publish: bool) -> tuple[list[float], dict]:
    """(b), (c), (d): the Trainer over the same batches; only fit() is timed."""
    model, opt = make_model()
    run_dir = tempfile.mkdtemp(prefix="offloop-bench-")
    loader = Stamped(batches)
    try:
        trainer = Trainer(model, loader, max_duration=f"{len(batches)}ba", loss_fn=F.cross_entropy,
                          optimizers=opt, run_dir=run_dir, callbacks=callbacks, publish=publish,
                          eval_dataloader=None, seed=SEED, worker_shutdown_timeout=5)
        trainer.fit()
        drops = trainer.publisher.drops if trainer.publisher is not None else 0
        trainer.close()
        reports = [w.report for w in trainer.workers.workers]
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    info = {"publisher_drops": drops}
    if any(reports):  # a worker's own count, sent with its fit_end acknowledgement
        info["worker_events"] = sum(r.get("events", 0) for r in reports)
        info["worker_gaps"] = sum(r.get("gaps", 0) for r in reports)
    return loader.step_us(warmup), info


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1500, help="timed steps per case (a)-(d) and round")
    parser.add_argument("--warmup", type=int, default=200, help="steps discarded first, per case and round")
    parser.add_argument("--rounds", type=int, default=6, help="rounds of (a)-(d), run one after another")
    parser.add_argument("--heavy-steps", type=int, default=20, help="timed steps for case (e)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    batches = make_batches(args.warmup + args.steps + 1)

    # (a)-(d) take turns, round after round, so a slow spell of this shared machine
    # falls on every case rather than on one; each case's figure pools its rounds.
    cases = {"plain": [], "bus_off": [], "bus_on": [], "heavy_workers": []}
    info: dict[str, dict] = {case: {} for case in cases}
    for r in range(args.rounds):
        cases["plain"].append(plain_loop(batches, args.warmup))
        for case, callbacks, publish in (
            ("bus_off", [], False),
            ("bus_on", [EveryEvent()], True),
            ("heavy_workers", [Heavy() for _ in range(HEAVY_WORKERS)], True),
        ):
            steps, extra = trainer_loop(batches, args.warmup, callbacks, publish)
            cases[case].append(steps)
            for key, value in extra.items():
                info[case][key] = info[case].get(key, 0) + value
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{case} {statistics.median(rounds[-1]):.1f} us" for case, rounds in cases.items()),
            file=sys.stderr, flush=True)
    heavy_warmup = 2
    cases["inprocess_heavy"] = [plain_loop(batches[:heavy_warmup + args.heavy_steps + 1], heavy_warmup,
                                           [Heavy() for _ in range(HEAVY_WORKERS)])]

    med = {}
    for case, rounds in cases.items():
        line = summarize(case, rounds, **info.get(case, {}))
        med[case] = line["median_us"]
        print(json.dumps(line), flush=True)

    def per_round(num: str, den: str) -> list[float]:
        return [round(statistics.median(n) / statistics.median(d), 3)
                for n, d in zip(cases[num], cases[den], strict=True)]

    bus_on_rounds, heavy_rounds = per_round("bus_on", "plain"), per_round("heavy_workers", "bus_on")
    print(json.dumps({
        "plain_us": med["plain"],
        "bus_off_us": med["bus_off"],
        "bus_on_us": med["bus_on"],
        "heavy_workers_us": med["heavy_workers"],
        "inprocess_heavy_us": med["inprocess_heavy"],
        "ratio_bus_off": round(med["bus_off"] / med["plain"], 3),
        "ratio_bus_on": round(med["bus_on"] / med["plain"], 3),
        "ratio_heavy": round(med["heavy_workers"] / med["bus_on"], 3),
        "ratio_inprocess_heavy": round(med["inprocess_heavy"] / med["heavy_workers"], 1),
        "ratio_bus_on_rounds": bus_on_rounds,
        "ratio_heavy_rounds": heavy_rounds,
        # each round's (a) and (c) ran seconds apart: the median of their ratios is the
        # figure a slow spell of the machine moves least
        "ratio_bus_on_round_median": round(statistics.median(bus_on_rounds), 3),
        "ratio_heavy_round_median": round(statistics.median(heavy_rounds), 3),
        "steps": args.steps, "rounds": args.rounds, "heavy_steps": args.heavy_steps,
        "torch": torch.__version__, "threads": torch.get_num_threads(),
    }))


if __name__ == "__main__":
    main()
