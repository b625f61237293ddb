"""`offloop replay <file> <callback>...`: feed a recording to callbacks, offline.

Exit 0 when every callback ran clean; 1 when any raised (replay is how a callback is
tested), 2 when the recording or a callback spec is bad.
"""

from __future__ import annotations

import argparse
import sys

from offloop.errors import abort


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recording", help="a recording written by the Recorder callback")
    parser.add_argument("callbacks", nargs="*", metavar="CALLBACK",
                        help="as for `offloop worker`: a built-in name or pkg.mod:Class(literal args)")
    parser.add_argument("--config", help="JSON/TOML file with a 'callbacks' list")
    parser.add_argument("--jsonl", help="also log metrics to this JSONL file")
    parser.add_argument("--quiet", action="store_true", help="no console logging")


def run(args: argparse.Namespace) -> int:
    from offloop.bus import WireError
    from offloop.workers.destinations import ConsoleLogger, JSONLLogger
    from offloop.workers.replay import replay
    from offloop.workers.spec import SpecError, callbacks_from

    try:
        config, callbacks = callbacks_from(args.callbacks, args.config)
    except SpecError as exc:
        abort(str(exc))
    destinations = [] if args.quiet else [ConsoleLogger()]
    if args.jsonl:
        destinations.append(JSONLLogger(args.jsonl))
    try:
        worker = replay(args.recording, callbacks, destinations)
    except WireError as exc:
        abort(str(exc))
    print(f"offloop replay: {worker.stats.events} events replayed, {worker.stats.gaps} recorded as lost, "
          f"{worker.malformed} unreadable, {worker.stats.errors} callback errors, "
          f"{len(worker.replay_requests)} control requests printed (not sent)"
          + ("; the recording ends inside a record (cut short): what came before it was replayed"
             if worker.truncated else ""), file=sys.stderr)
    if worker.stats.errors:
        # replay is how callbacks are tested: one that raised fails the replay
        abort(f"{worker.stats.errors} callback error{'s' if worker.stats.errors != 1 else ''} "
              "during the replay (each traceback is above)", 1)
    return 0
