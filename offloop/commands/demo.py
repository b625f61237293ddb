"""`offloop demo`: a real model trains on scikit-learn's digits with callbacks out of process.

Five callbacks, in one worker process beside the trainer: a progress display, a JSONL metrics
log, an early stopper that halts the run over the control channel, a checkpoint
saver, and a recorder. The demo ends by reporting eval accuracy and where
everything was written. `--step-delay` slows each batch down, so that a person has
minutes to `ls`, `attach`, `checkpoint` and `halt` it by hand.

The dataset comes from scikit-learn, which is the `demo` extra
(`pip install 'offloop[demo]'`), not a dependency of the library.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

from offloop.errors import abort


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-dir", default=None,
                        help="where the run's files go (default: demo-<time> under $OFFLOOP_RUNS or ./runs)")
    parser.add_argument("--max-duration", default="40ep",
                        help="Composer time string, e.g. '40ep', '300ba' (default: 40ep)")
    parser.add_argument("--patience", type=int, default=3, help="EarlyStopper patience, in epochs")
    parser.add_argument("--step-delay", type=float, default=0.0, metavar="SECONDS",
                        help="sleep this long in every training batch, to watch and steer the run by "
                             "hand (0.1 makes an epoch last about 2.5 s; default: 0)")
    parser.add_argument("--seed", type=int, default=17)
    parser.add_argument("--autoresume", action="store_true",
                        help="resume from the newest checkpoint in the run directory, if it has one "
                             "(a restarted container carries on where SIGTERM's checkpoint left off)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address the run's sockets bind to (beyond loopback needs --keys or --insecure)")
    parser.add_argument("--keys", default=os.environ.get("OFFLOOP_KEYS"),
                        help="keys folder from `offloop keys`: every socket then needs an authorised key")
    parser.add_argument("--insecure", action="store_true",
                        help="allow binding beyond loopback without keys (anyone reachable may halt the run)")


def digits_loaders(seed: int, batch_size: int = 64, step_delay: float = 0.0):
    """scikit-learn's bundled 8x8 digits (no download), standardised, split 80/20. With a
    `step_delay`, each training batch takes that much longer to load."""
    import torch
    from sklearn.datasets import load_digits
    from torch.utils.data import DataLoader, TensorDataset, default_collate

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    cut = int(0.8 * len(x))
    mean, std = x[:cut].mean(0), x[:cut].std(0) + 1e-3
    x = (x - mean) / std
    gen = torch.Generator().manual_seed(seed)

    def collate(samples):
        time.sleep(step_delay)  # once per batch, inside the loop: the run is simply slower
        return default_collate(samples)

    train = DataLoader(TensorDataset(x[:cut], y[:cut]), batch_size=batch_size, shuffle=True, generator=gen,
                       collate_fn=collate if step_delay > 0 else None)
    evaluation = DataLoader(TensorDataset(x[cut:], y[cut:]), batch_size=256)
    return train, evaluation


def newest_checkpoint(folder: Path) -> Path | None:
    """The checkpoint written last in `folder` (an epoch's, a request's or SIGTERM's), if any."""
    found = [path for path in folder.glob("*.pt") if path.is_file()]
    return max(found, key=lambda path: path.stat().st_mtime_ns, default=None)


def _require_scikit_learn() -> None:
    try:
        import sklearn  # noqa: F401
    except ImportError:
        abort("offloop demo needs scikit-learn for its dataset, which is not installed: "
              "pip install 'offloop[demo]' (or `make demo` in a clone)", 1)


def run(args: argparse.Namespace) -> int:
    if not (math.isfinite(args.step_delay) and args.step_delay >= 0):
        abort(f"--step-delay: {args.step_delay:g} is not a number of seconds >= 0")
    _require_scikit_learn()
    import torch
    import torchmetrics
    from torch import nn

    from offloop.bus import Time, default_runs_root
    from offloop.bus.duration import DurationError
    from offloop.commands.shell import command
    from offloop.trainer import ConfigError, Trainer
    from offloop.workers.callbacks import (
        CheckpointSaver,
        EarlyStopper,
        LogMetricsCallback,
        PrintProgressCallback,
        Recorder,
    )

    try:
        Time.parse(args.max_duration)
    except DurationError as exc:
        abort(f"--max-duration: {exc}")
    started = time.monotonic()
    run_dir = Path(args.run_dir or default_runs_root() / f"demo-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    train, evaluation = digits_loaders(args.seed, step_delay=args.step_delay)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.2), nn.Linear(128, 10))
    metrics_log = run_dir / "metrics.jsonl"
    recording = run_dir / "recording.offloop"
    callbacks = [
        PrintProgressCallback(),
        LogMetricsCallback(jsonl_path=str(metrics_log)),
        EarlyStopper(monitor="MulticlassAccuracy", dataloader_label="eval", patience=args.patience,
                     min_delta=0.002),
        CheckpointSaver(folder=str(run_dir / "checkpoints"), save_interval="1ep", num_checkpoints_to_keep=2),
        Recorder(str(recording)),
    ]
    slowed = f", slowed by {args.step_delay:g} s a batch" if args.step_delay else ""
    print(f"offloop demo: training an MLP on scikit-learn digits for up to {args.max_duration}{slowed}; "
          f"{len(callbacks)} callbacks in a worker process", flush=True)
    resume_from = newest_checkpoint(run_dir / "checkpoints") if args.autoresume else None
    try:
        trainer = Trainer(
            model, train, args.max_duration,
            optimizers=torch.optim.Adam(model.parameters(), lr=1e-3),
            loss_fn=nn.functional.cross_entropy,
            eval_dataloader=evaluation, eval_interval="1ep",
            eval_metrics=torchmetrics.classification.MulticlassAccuracy(num_classes=10),
            callbacks=callbacks, run_dir=run_dir, seed=args.seed,
            progress_bar=False,  # the demo's own progress display is its first callback
            host=args.host, keys=args.keys, insecure=args.insecure,
            hparams={"lr": 1e-3, "batch_size": 64, "hidden": 128},
            load_path=resume_from,
        )
    except ConfigError as exc:
        abort(str(exc))
    if resume_from is not None:
        print(f"offloop demo: resumed from {resume_from} at epoch {trainer.timestamp.epoch}, "
              f"batch {trainer.timestamp.batch}", flush=True)
    hints = [(command("attach", run_dir), "live monitor (read-only)"),
             (command("checkpoint", run_dir), "write a checkpoint now"),
             (command("halt", run_dir), "stop after the current batch")]
    width = max(len(line) for line, _ in hints)
    print(f"offloop demo: run {trainer.run_name} in {run_dir}; from another terminal:", flush=True)
    for line, what in hints:
        print(f"  {line.ljust(width)}  # {what}", flush=True)
    trainer.fit()
    results = trainer.eval()
    trainer.close()
    accuracy = results["eval"]["MulticlassAccuracy"]
    stopped = trainer.stopped_by
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").glob("*.pt"))
    print()
    print(f"offloop demo: finished in {time.monotonic() - started:.1f}s at epoch {trainer.timestamp.epoch}, "
          f"batch {trainer.timestamp.batch}")
    if stopped:
        print(f"  stopped by    {stopped['client']} ({stopped['reason']}) after batch {stopped['step']}")
    else:
        print(f"  ran to        {args.max_duration} (the early stopper did not fire)")
    print(f"  eval accuracy {accuracy:.4f}")
    print(f"  run directory {run_dir}")
    print(f"  metrics log   {metrics_log}")
    print(f"  checkpoints   {', '.join(checkpoints) or 'none'} in {run_dir / 'checkpoints'}")
    print(f"  recording     {recording}  (try: {command('replay', recording, 'LRMonitor')})")
    if trainer.workers.crashes:
        print("  worker problems: " + "; ".join(trainer.workers.crashes), file=sys.stderr)
        return 1
    return 0
