"""The figures docs/reliability.md quotes, printed by the tests that measure them."""

from __future__ import annotations

import json


def report(case: str, **figures) -> None:
    """One JSON line naming the case; shown with `pytest -s`."""
    print(json.dumps({"case": case, **figures}))


def memory(pid: int) -> dict[str, int]:
    """Resident (VmRSS) and peak resident (VmHWM) memory of a process, in bytes, from /proc."""
    fields = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024
    return fields
