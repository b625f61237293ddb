"""The CLI's one error type and `abort()`: a clear message and an exit code."""

from __future__ import annotations

import sys


class CliError(Exception):
    """A user-facing failure: printed as one line, exits non-zero."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def abort(message: str, code: int = 2) -> None:
    raise CliError(message, code)


def report(error: CliError) -> int:
    print(f"offloop: error: {error}", file=sys.stderr)
    return error.code
