"""Commands the CLI prints for a person to type: they must work as printed.

A fresh clone's `make demo` installs `offloop` in `.venv/bin`, which is not on PATH
unless the virtualenv is activated; a hint saying bare `offloop` would then be
"command not found". So a printed command names `offloop` only when PATH finds this
very installation, and otherwise the console script's absolute path.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path


def offloop_command() -> str:
    """How to type `offloop` so that it runs this installation, from any directory."""
    script = Path(sys.executable).parent / "offloop"
    if not script.is_file():  # not installed as a console script (run as `python -m offloop.cli`)
        return f"{shlex.quote(sys.executable)} -m offloop.cli"
    found = shutil.which("offloop")
    try:
        if found and os.path.samefile(found, script):
            return "offloop"
    except OSError:
        pass
    return shlex.quote(str(script.absolute()))


def command(*words: str | os.PathLike) -> str:
    """`offloop WORD...` as a shell line that works as printed."""
    return " ".join([offloop_command(), *(shlex.quote(str(word)) for word in words)])
