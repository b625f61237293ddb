"""The packages the checkout's offloop/ holds: what the wheel and pyproject must list."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def package_names(top: Path = ROOT / "offloop") -> set[str]:
    """Every package under `top`, its symlinked folders (bus/, trainer/, workers/) followed."""
    return {".".join(Path(folder).relative_to(top.parent).parts)
            for folder, _, files in os.walk(top, followlinks=True) if "__init__.py" in files}
