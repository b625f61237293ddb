"""`offloop` entry point: parses the command line and hands off to one command module."""

from __future__ import annotations

import argparse
import importlib
import sys

from offloop.errors import CliError, report

#: command name -> (module under offloop.commands, one-line help)
COMMANDS = {
    "demo": ("demo", "publish events from a small job and receive them in another process"),
    "worker": ("worker", "run callbacks against a run (a run directory, name or endpoint)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="offloop", description="Training-loop callbacks that "
                                     "run off the loop.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in COMMANDS.items():
        sub = commands.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(f"offloop.commands.{module}").add_arguments(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module = importlib.import_module(f"offloop.commands.{COMMANDS[args.command][0]}")
    try:
        return module.run(args) or 0
    except CliError as error:
        return report(error)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
