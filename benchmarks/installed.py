"""offloop's modules compiled to bytecode, as an install leaves them, before a benchmark
times a process that imports them.

pip compiles a package's modules when it installs it, and Python caches the bytecode of
an editable checkout at its first import. Where neither happened (a checkout on a machine
that sets PYTHONDONTWRITEBYTECODE, as this one does), every process would compile offloop
from source at its start, a cost no user pays, charged to offloop's side of the comparison
(the libraries it is compared with are installed, compiled; docs/benchmarks.md).
"""

from __future__ import annotations

import os
import py_compile
from importlib.util import cache_from_source
from pathlib import Path

import offloop

__all__ = ["cache_bytecode"]


def cache_bytecode() -> int:
    """Compile every module of offloop that has no bytecode cached yet (following the
    checkout's symlinked packages); the number compiled."""
    compiled = 0
    for folder, _, files in os.walk(Path(offloop.__file__).parent, followlinks=True):
        for name in files:
            source = os.path.join(folder, name)
            if name.endswith(".py") and not os.path.exists(cache_from_source(source)):
                py_compile.compile(source, doraise=True)
                compiled += 1
    return compiled
