"""The figures docs/reliability.md quotes, printed by the tests that measure them."""

from __future__ import annotations

import json


def report(case: str, **figures) -> None:
    """One JSON line naming the case; shown with `pytest -s`."""
    print(json.dumps({"case": case, **figures}))
