"""Compose healthchecks for offloop's services (docker-compose.yml); exit 0 when healthy.

    python deploy/healthcheck.py run RUN     RUN's run.json says it is live (and, on this
                                             host, its trainer's process exists)
    python deploy/healthcheck.py http URL    URL answers 200 within 3 s

RUN is a run name under $OFFLOOP_RUNS or a run directory.
"""

from __future__ import annotations

import socket
import sys
import urllib.request


def run_is_live(run: str) -> str | None:
    """None if `run` is live, else why not."""
    from offloop.bus import BusError, find_run
    from offloop.bus.discovery import pid_alive

    try:
        info = find_run(run)
    except BusError as exc:
        return str(exc)
    if info.finished:
        return f"run {run} has finished"
    if info.host == socket.gethostname() and not pid_alive(info.pid):  # a pid means something on its host only
        return f"run {run}'s trainer (pid {info.pid}) is gone"
    return None


def answers(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=3) as response:
            return None if response.status == 200 else f"{url} answered {response.status}"
    except OSError as exc:
        return f"{url}: {exc}"


def main(argv: list[str]) -> int:
    checks = {"run": run_is_live, "http": answers}
    if len(argv) != 2 or argv[0] not in checks:
        print(__doc__, file=sys.stderr)
        return 2
    problem = checks[argv[0]](argv[1])
    if problem:
        print(f"unhealthy: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
