"""Composer's `MemoryMonitor`: the trainer's memory use, as published with each batch_end.

On CUDA the trainer reads its allocator's counters on the host (no device sync); on
the CPU it publishes its peak resident set size. Bytes are logged in gigabytes.
"""

from __future__ import annotations

from typing import Any

from offloop.workers.callback import Callback

__all__ = ["MemoryMonitor"]

#: published statistic -> logged name (`memory/{name}`), Composer's names where they exist
DEFAULT_MEMORY_KEYS = {
    "allocated_bytes": "current_allocated_mem",
    "reserved_bytes": "current_reserved_mem",
    "max_allocated_bytes": "peak_allocated_mem",
    "max_rss_bytes": "peak_rss_mem",
}

#: torch.cuda.memory_stats() names (Composer's memory_keys) -> the statistic the trainer publishes
_TORCH_NAMES = {
    "allocated_bytes.all.current": "allocated_bytes",
    "reserved_bytes.all.current": "reserved_bytes",
    "allocated_bytes.all.peak": "max_allocated_bytes",
}


class MemoryMonitor(Callback):
    """Logs `memory/{name}` for each statistic the trainer publishes, at every batch_end.

    Args:
        memory_keys: which statistics to log and under which names, {statistic: name}.
            Statistics are the published ones (allocated_bytes, reserved_bytes,
            max_allocated_bytes on CUDA; max_rss_bytes on the CPU) or Composer's
            torch.cuda.memory_stats() names for them ('allocated_bytes.all.current',
            'reserved_bytes.all.current', 'allocated_bytes.all.peak'). Default: all of
            them, as current_allocated_mem, current_reserved_mem, peak_allocated_mem
            and peak_rss_mem.
    """

    def __init__(self, memory_keys: dict[str, str] | None = None) -> None:
        if memory_keys is not None and not isinstance(memory_keys, dict):
            raise ValueError(f"MemoryMonitor: memory_keys must be a dict {{statistic: name}}, "
                             f"got {type(memory_keys).__name__}")
        keys = DEFAULT_MEMORY_KEYS if memory_keys is None else memory_keys
        self.memory_keys = {_TORCH_NAMES.get(stat, stat): str(name) for stat, name in keys.items()}
        self._missing_noted = False

    def batch_end(self, state, logger) -> None:
        memory = state.memory
        if not memory:
            return
        report = {f"memory/{name}": _value(stat, memory[stat])
                  for stat, name in self.memory_keys.items() if stat in memory}
        if report:
            logger.log_metrics(report)
        elif not self._missing_noted:
            self._missing_noted = True
            logger.log_text(f"MemoryMonitor: none of {sorted(self.memory_keys)} is published by this "
                            f"trainer (it publishes {sorted(memory)})")


def _value(stat: str, value: Any) -> Any:
    """Bytes as gigabytes with 5 significant digits, as Composer logs them; counts as they are."""
    if "bytes" in stat and isinstance(value, (int, float)):
        return float(f"{value / 1e9:.5g}")
    return value
