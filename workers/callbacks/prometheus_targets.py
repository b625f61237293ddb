"""Prometheus's file service discovery for every live exporter on a host.

Each PrometheusExporter writes one file, `<runs root>/prometheus-targets/<run id>-rank<N>-
<pid>.json`, in the format of Prometheus's `file_sd_configs`, while it serves, and removes
it when it stops. One scrape job whose `files:` glob names that folder finds every run on
the host without an edit to prometheus.yml (docs/prometheus.md). A file left by a process
that was killed names its pid: the next exporter started on the host removes it.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from offloop.bus.discovery import default_runs_root, pid_alive, write_json_atomically

__all__ = ["TARGETS_FOLDER", "TargetFile", "default_targets_dir"]

TARGETS_FOLDER = "prometheus-targets"


def default_targets_dir() -> Path:
    """$OFFLOOP_RUNS/prometheus-targets (./runs/prometheus-targets by default)."""
    return default_runs_root() / TARGETS_FOLDER


class TargetFile:
    """One exporter's entry in the targets folder."""

    def __init__(self, folder: str | os.PathLike, run_id: str, rank: int) -> None:
        self.folder = Path(folder)
        self.path = self.folder / f"{_safe(run_id) or 'run'}-rank{int(rank)}-{os.getpid()}.json"

    def write(self, addr: str, port: int, labels: dict[str, str]) -> Path:
        """List `addr`:`port` (the host's name where it listens on every address)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        remove_stale(self.folder)
        host = socket.gethostname() if addr in ("", "0.0.0.0", "::") else addr
        host = f"[{host}]" if ":" in host else host
        return write_json_atomically(self.path, [{"targets": [f"{host}:{port}"], "labels": labels}], indent=2)

    def remove(self) -> None:
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


def remove_stale(folder: Path) -> None:
    """Remove the files of exporters whose process no longer exists on this host."""
    for path in folder.glob("*-rank*-*.json"):
        pid = path.stem.rsplit("-", 1)[-1]
        if pid.isdigit() and not pid_alive(int(pid)):
            try:
                path.unlink()
            except FileNotFoundError:
                pass



def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in text)[:64]
