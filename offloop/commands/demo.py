"""`offloop demo`: a real model trains on scikit-learn's digits with callbacks out of process.

Five callbacks, each in its own worker process: a progress display, a JSONL metrics
log, an early stopper that halts the run over the control channel, a checkpoint
saver, and a recorder. The demo ends by reporting eval accuracy and where
everything was written.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from offloop.errors import abort


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-dir", default=None,
                        help="where the run's files go (default: runs/demo-<time>)")
    parser.add_argument("--max-duration", default="40ep",
                        help="Composer time string, e.g. '40ep', '300ba' (default: 40ep)")
    parser.add_argument("--patience", type=int, default=3, help="EarlyStopper patience, in epochs")
    parser.add_argument("--seed", type=int, default=17)
    parser.add_argument("--host", default="127.0.0.1",
                        help="address the run's sockets bind to (beyond loopback needs --keys or --insecure)")
    parser.add_argument("--keys", default=os.environ.get("OFFLOOP_KEYS"),
                        help="keys folder from `offloop keys`: every socket then needs an authorised key")
    parser.add_argument("--insecure", action="store_true",
                        help="allow binding beyond loopback without keys (anyone reachable may halt the run)")


def digits_loaders(seed: int, batch_size: int = 64):
    """scikit-learn's bundled 8x8 digits (no download), standardised, split 80/20."""
    import torch
    from sklearn.datasets import load_digits
    from torch.utils.data import DataLoader, TensorDataset

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    cut = int(0.8 * len(x))
    mean, std = x[:cut].mean(0), x[:cut].std(0) + 1e-3
    x = (x - mean) / std
    gen = torch.Generator().manual_seed(seed)
    train = DataLoader(TensorDataset(x[:cut], y[:cut]), batch_size=batch_size, shuffle=True, generator=gen)
    evaluation = DataLoader(TensorDataset(x[cut:], y[cut:]), batch_size=256)
    return train, evaluation


def run(args: argparse.Namespace) -> int:
    import torch
    import torchmetrics
    from torch import nn

    from offloop.bus import Time
    from offloop.bus.duration import DurationError
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
    run_dir = Path(args.run_dir or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    train, evaluation = digits_loaders(args.seed)
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
    print(f"offloop demo: training an MLP on scikit-learn digits for up to {args.max_duration}; "
          f"{len(callbacks)} callbacks in worker processes", flush=True)
    try:
        trainer = Trainer(
            model, train, args.max_duration,
            optimizers=torch.optim.Adam(model.parameters(), lr=1e-3),
            loss_fn=nn.functional.cross_entropy,
            eval_dataloader=evaluation, eval_interval="1ep",
            eval_metrics=torchmetrics.classification.MulticlassAccuracy(num_classes=10),
            callbacks=callbacks, run_dir=run_dir, seed=args.seed,
            host=args.host, keys=args.keys, insecure=args.insecure,
            hparams={"lr": 1e-3, "batch_size": 64, "hidden": 128},
        )
    except ConfigError as exc:
        abort(str(exc))
    print(f"offloop demo: run {trainer.run_name} in {run_dir} — watch it with "
          f"`offloop attach {run_dir}`", flush=True)
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
    print(f"  recording     {recording}  (try: offloop replay {recording} LRMonitor)")
    if trainer.workers.crashes:
        print("  worker problems: " + "; ".join(trainer.workers.crashes), file=sys.stderr)
        return 1
    return 0
