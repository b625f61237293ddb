"""A process's memory as Linux counts it, for the benchmarks that attack a trainer's."""

from __future__ import annotations

__all__ = ["rss_mib"]


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    """`field` of /proc/<pid>/status (VmRSS: resident now; VmHWM: its peak), in MiB."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key == field:
                return int(value.split()[0]) / 1024
    raise RuntimeError(f"no {field} for pid {pid}")
