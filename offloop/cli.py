"""`offloop` entry point: parses the command line and hands off to one command module."""

from __future__ import annotations

import argparse
import importlib
import sys

from offloop.errors import CliError, report

#: command name -> (module, add-arguments function, run function, one-line help)
COMMANDS = {
    "demo": ("demo", "add_arguments", "run",
             "train a real model with callbacks running out of process"),
    "worker": ("worker", "add_arguments", "run",
               "run callbacks against a run (a run directory, name or endpoint)"),
    "halt": ("control", "add_halt_arguments", "run_halt",
             "stop a run after its current batch; prints the step"),
    "checkpoint": ("control", "add_checkpoint_arguments", "run_checkpoint",
                   "have a run write a checkpoint; prints its path and step"),
    "attach": ("attach", "add_arguments", "run", "watch a running job live in the terminal (read-only)"),
    "ls": ("ls", "add_arguments", "run", "list runs, live or finished, with their progress"),
    "keys": ("keys", "add_arguments", "run", "create CURVE keys for a trainer and its clients"),
    "relay": ("relay", "add_arguments", "run",
              "forward a run's events, state and control to many monitors (other hosts)"),
    "replay": ("replay", "add_arguments", "run", "feed a recording to callbacks, offline"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="offloop", description="Training-loop callbacks that "
                                     "run off the loop.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, add, _, help_text) in COMMANDS.items():
        sub = commands.add_parser(name, help=help_text, description=help_text)
        getattr(importlib.import_module(f"offloop.commands.{module}"), add)(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module, _, run, _ = COMMANDS[args.command]
    try:
        return getattr(importlib.import_module(f"offloop.commands.{module}"), run)(args) or 0
    except CliError as error:
        return report(error)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
