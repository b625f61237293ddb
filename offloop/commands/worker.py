"""`offloop worker <run> <callback>...`: run callbacks against a run, in this process."""

from __future__ import annotations

import argparse
import os
import sys

from offloop.errors import abort

#: seconds a monitor on another host waits out a silence (a partition, a trainer's host
#: rebooting) before it gives up; the trainer never waits for it meanwhile
GIVE_UP_AFTER = 60.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="run directory, run name (under --runs-root) or state endpoint tcp://host:port")
    parser.add_argument("callbacks", nargs="*", metavar="CALLBACK",
                        help="built-in name or pkg.mod:Class, optionally called with literals: "
                             "'EarlyStopper(monitor=\"MulticlassAccuracy\", dataloader_label=\"eval\", patience=2)'")
    parser.add_argument("--config", help="JSON/TOML file: {\"callbacks\": [\"LRMonitor\", {\"name\": ..., \"args\": {...}}]}")
    parser.add_argument("--runs-root", help="where run names are looked up (default $OFFLOOP_RUNS or ./runs)")
    parser.add_argument("--jsonl", help="also log metrics to this JSONL file")
    parser.add_argument("--tensorboard", help="also log metrics as TensorBoard event files in this folder")
    parser.add_argument("--quiet", action="store_true", help="no console logging")
    parser.add_argument("--keep-failing", action="store_true",
                        help="keep calling a callback after it raised (default: disable it)")
    parser.add_argument("--stay", action="store_true",
                        help="stay after fit_end until the run closes its stream")
    parser.add_argument("--keys", default=os.environ.get("OFFLOOP_KEYS"),
                        help="keys folder (from `offloop keys`) for a run that has keys ($OFFLOOP_KEYS)")
    parser.add_argument("--key-name", default="client", help="which client key pair in --keys")
    parser.add_argument("--heartbeat-timeout", type=float, default=10.0,
                        help="seconds without a heartbeat before the trainer counts as silent (reported)")
    parser.add_argument("--give-up-after", type=float, default=GIVE_UP_AFTER, metavar="SECONDS",
                        help="seconds of silence waited out before the trainer counts as gone and the worker "
                             f"exits with status 3 (default {GIVE_UP_AFTER:g}): a network partition shorter "
                             "than this is reported, what it cost is counted, and on heal the worker takes "
                             "the run's state again and goes on")
    parser.add_argument("--nice", type=_nice, default=10,
                        help="added to this process's nice value, 0-19 (default 10, as the trainer's own "
                             "workers): on a machine it shares with training, the training loop runs first")


def _nice(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 19:
        raise argparse.ArgumentTypeError(f"must be an int between 0 and 19, got {text!r}")
    return value


def run(args: argparse.Namespace) -> int:
    if args.nice:  # first, while this is the only thread: every thread started later inherits it
        os.nice(args.nice)
    from offloop.bus import BusError, find_run
    from offloop.bus.security import endpoint_keys
    from offloop.workers import CallbackRuntime
    from offloop.workers.destinations import ConsoleLogger, JSONLLogger, TensorboardLogger
    from offloop.workers.spec import SpecError, callbacks_from

    if args.give_up_after < args.heartbeat_timeout:
        abort(f"--give-up-after must be at least --heartbeat-timeout ({args.heartbeat_timeout:g}), "
              f"got {args.give_up_after:g}")
    try:
        config, callbacks = callbacks_from(args.callbacks, args.config)
    except SpecError as exc:
        abort(str(exc))
    try:
        info = find_run(args.run, args.runs_root, curve=endpoint_keys(args.run, args.keys, args.key_name))
    except BusError as exc:
        abort(str(exc))
    if info.finished:
        abort(f"run {info.run_name} has finished; use `offloop replay` on its recording instead")
    destinations = [] if args.quiet else [ConsoleLogger()]
    if args.jsonl or config.get("jsonl"):
        destinations.append(JSONLLogger(args.jsonl or config["jsonl"]))
    if args.tensorboard or config.get("tensorboard"):
        # event files straight in the folder named, flushed at every step
        destinations.append(TensorboardLogger(args.tensorboard or config["tensorboard"],
                                              flush_interval=1, run_folder=False))
    try:
        worker = CallbackRuntime(info, callbacks, destinations=destinations,
                                 disable_on_error=not args.keep_failing,
                                 exit_on_fit_end=not args.stay,
                                 heartbeat_timeout=args.heartbeat_timeout,
                                 give_up_after=args.give_up_after, keys=args.keys,
                                 key_name=args.key_name)
        worker.connect()
    except BusError as exc:
        abort(f"cannot join run {info.run_name}: {exc}", 3)
    print(f"offloop worker: joined run {info.run_name} with {worker.name}", file=sys.stderr, flush=True)
    code = worker.run()
    stats, sub = worker.stats, worker.subscriber_stats
    silences = (f"; {sub.silences} silences waited out, {sub.resyncs} resyncs folding in {sub.resynced} "
                f"values" if sub.silences else "")
    print(f"offloop worker: {worker.exit_message}; handled {stats.events} events, {stats.gaps} lost, "
          f"{sub.duplicates} duplicates, {stats.errors} callback errors{silences}", file=sys.stderr, flush=True)
    return code
