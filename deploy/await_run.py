"""Compose entry for a monitor: wait until a run is live, then become the given command.

    python deploy/await_run.py RUN [--timeout S] -- offloop worker RUN CALLBACK...

RUN is a run name under $OFFLOOP_RUNS or a run directory. The command is exec'd (same
pid, same signals) once RUN's run.json exists and is not marked finished; after
`--timeout` seconds without one this exits 4, and compose's restart policy decides.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="run name (under $OFFLOOP_RUNS) or run directory")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait (default 600)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")

    from offloop.bus import BusError, find_run

    deadline = time.monotonic() + args.timeout
    print(f"await_run: waiting for run {args.run} to start", file=sys.stderr, flush=True)
    while True:
        try:
            if not find_run(args.run).finished:
                break
        except BusError:
            pass  # not there yet, or run.json being replaced
        if time.monotonic() > deadline:
            print(f"await_run: run {args.run} did not start within {args.timeout:g}s", file=sys.stderr)
            return 4
        time.sleep(0.5)
    sys.stdout.flush()
    os.execvp(command[0], command)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
