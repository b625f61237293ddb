"""Workers benchmark: what a Trainer's callback workers cost around a run, not in it.

In notebooks, tests and short jobs the fixed cost around training is most of the wait, so
this measures it with the demo's five callbacks (progress, JSONL metrics, an early stopper,
a checkpoint saver, a recorder) on a tiny model, the model, optimizer and data built
beforehand (an optimizer's first construction imports torch._dynamo, about a second, which
any PyTorch trainer pays), each figure over `--runs` runs, median and mean:

  trainer_start_s   Trainer(...) with the demo's callbacks, until `init` is published
                    (its workers started and listening)               target <= 1.0 s
  worker_start_s    what the workers add to that: trainer_start_s minus the same Trainer
                    without callbacks, run for run (start a process, rebuild the callbacks,
                    join the run)                                      target <= 0.5 s
  close_s           close() after a short fit, the workers idle        target <= 0.5 s
  worker_rss_mib    resident memory of the demo's worker process after the fit
                                                                       target <= 60 MiB
  workers_for_demo  worker processes the demo's callbacks take by default  target <= 2
  worker_rss_torch_mib  the same for a worker whose callback uses torch (it imports it)

Prints one JSON object per run and, last, a summary object with the targets.
What it does not show: a model whose checkpoint takes long to write, workers with a
backlog at close (close() then waits up to `worker_shutdown_timeout`), a cold disk cache.

Run: python benchmarks/workers.py [--runs N]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from installed import cache_bytecode

from offloop.trainer import Trainer
from offloop.workers import Callback
from offloop.workers.callbacks import (
    CheckpointSaver,
    EarlyStopper,
    LogMetricsCallback,
    PrintProgressCallback,
    Recorder,
)

TARGETS = {"trainer_start_s": 1.0, "worker_start_s": 0.5, "close_s": 0.5, "worker_rss_mib": 60,
           "workers_for_demo": 2}


class UsesTorch(Callback):
    """A callback whose method uses torch: its worker imports torch to rebuild it."""

    def batch_end(self, state, logger) -> None:
        torch.tensor(state.loss or 0.0)


def demo_callbacks(run_dir: Path) -> list:
    """The five callbacks `offloop demo` runs, with its options."""
    return [
        PrintProgressCallback(),
        LogMetricsCallback(jsonl_path=str(run_dir / "metrics.jsonl")),
        EarlyStopper(monitor="MulticlassAccuracy", dataloader_label="eval", patience=3, min_delta=0.002),
        CheckpointSaver(folder=str(run_dir / "checkpoints"), save_interval="1ep", num_checkpoints_to_keep=2),
        Recorder(str(run_dir / "recording.offloop")),
    ]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    raise RuntimeError(f"no VmRSS for pid {pid}")


def one_run(root: Path, callbacks_for) -> dict:
    """Build, fit 4 batches, close: the seconds of each part around the training."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [(torch.randn(16, 8), torch.randint(0, 2, (16,))) for _ in range(4)]
    run_dir = Path(tempfile.mkdtemp(dir=root))
    callbacks = callbacks_for(run_dir)
    started = time.perf_counter()
    trainer = Trainer(model, data, "1ep", optimizers=opt, loss_fn=F.cross_entropy, callbacks=callbacks,
                      run_dir=run_dir / "run")
    start_s = time.perf_counter() - started
    trainer.fit()
    rss = [rss_mib(w.process.pid) for w in trainer.workers.workers]
    closing = time.perf_counter()
    trainer.close()
    return {"start_s": round(start_s, 4), "close_s": round(time.perf_counter() - closing, 4),
            "workers": len(rss), "worker_rss_mib": rss}


def stats(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 3), "mean": round(statistics.fmean(values), 3),
            "max": round(max(values), 3)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cache_bytecode()  # a worker imports offloop as installed, not compiling it (installed.py)
    root = Path(tempfile.mkdtemp(prefix="offloop-bench-workers-"))
    try:
        torch.optim.SGD(torch.nn.Linear(1, 1).parameters())  # the one-time torch._dynamo import
        runs = []
        for i in range(args.runs):  # interleaved: the same machine for both, run after run
            bare = one_run(root, lambda _: [])
            demo = one_run(root, demo_callbacks)
            runs.append({"run": i, "bare": bare, "demo": demo})
            print(json.dumps(runs[-1]), flush=True)
        with_torch = one_run(root, lambda _: [UsesTorch()])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    start = [r["demo"]["start_s"] for r in runs]
    added = [r["demo"]["start_s"] - r["bare"]["start_s"] for r in runs]
    summary = {
        "trainer_start_s": stats(start)["median"], "trainer_start": stats(start),
        "worker_start_s": stats(added)["median"], "worker_start": stats(added),
        "close_s": stats([r["demo"]["close_s"] for r in runs])["median"],
        "close": stats([r["demo"]["close_s"] for r in runs]),
        "close_bare": stats([r["bare"]["close_s"] for r in runs]),
        "worker_rss_mib": max(x for r in runs for x in r["demo"]["worker_rss_mib"]),
        "workers_for_demo": runs[-1]["demo"]["workers"],
        "worker_rss_torch_mib": with_torch["worker_rss_mib"][0],
        "runs": args.runs, "torch": torch.__version__,
    }
    summary["targets"] = {key: {"target": target, "met": summary[key] <= target} for key, target in TARGETS.items()}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
