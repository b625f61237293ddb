"""The container tier's tools: the project's real Dockerfile and docker-compose.yml, run with
podman (Debian's, as root) and Debian's docker-compose (v1) through podman's Docker API.

`scripts/container-env.sh` prepares the machine once (packages, a containers.conf this
sandbox accepts, the test-only base and Prometheus images that stand in for what cannot be
pulled here, the API socket). Exit code 77 means podman genuinely cannot run here (not
root, no apt-get): the tier is then skipped, saying why; any other failure fails it.
"""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

import pytest

__all__ = ["Containers", "HealthDriver", "IMAGE", "ROOT", "environment"]

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "offloop:latest"


def environment() -> dict[str, str]:
    done = subprocess.run(["bash", str(ROOT / "scripts" / "container-env.sh")], capture_output=True, text=True,
                          timeout=1800, stdin=subprocess.DEVNULL)
    if done.returncode == 77:
        pytest.skip(done.stderr.strip().splitlines()[-1])
    assert done.returncode == 0, f"scripts/container-env.sh failed:\n{done.stderr[-4000:]}"
    env_file = Path(os.environ.get("OFFLOOP_CONTAINERS_DIR", "/tmp/offloop-containers")) / "env"
    sourced = subprocess.run(["bash", "-c", f". {env_file} && env -0"], capture_output=True, timeout=30,
                             check=True)
    return dict(line.split("=", 1) for line in sourced.stdout.decode().split("\0") if "=" in line)


class Containers:
    """podman and docker-compose with the tier's environment; every call bounded."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env

    def run(self, *args: str, timeout: float = 120, check: bool = True, cwd: Path = ROOT,
            extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        done = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, cwd=cwd,
                              stdin=subprocess.DEVNULL, env={**self.env, **(extra_env or {})})
        if check:
            assert done.returncode == 0, f"{' '.join(args)} exited {done.returncode}:\n" \
                                         f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done

    def podman(self, *args: str, **kw) -> subprocess.CompletedProcess:
        return self.run("podman", *args, **kw)


class HealthDriver:
    """Runs the containers' healthchecks every `interval` seconds, as a Docker engine does:
    podman schedules them with systemd timers, and there is no systemd here."""

    def __init__(self, containers: Containers, project: str, interval: float = 2.0) -> None:
        self.containers, self.project, self.interval = containers, project, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="health-driver")

    def __enter__(self) -> HealthDriver:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            listed = self.containers.podman("ps", "--filter", f"label=com.docker.compose.project={self.project}",
                                            "--format", "{{.Names}}", check=False, timeout=30)
            for name in listed.stdout.split():
                self.containers.podman("healthcheck", "run", name, check=False, timeout=30)
