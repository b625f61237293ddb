"""Shared fixtures: real processes started through one fixture, free ports, run dirs."""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
TESTS = Path(__file__).parent
PROGRAMS = TESTS / "programs"


class Proc:
    """A child process whose stdout is read as JSON lines, with deadlines on every wait."""

    def __init__(self, popen: subprocess.Popen) -> None:
        self.popen = popen
        self._buffer = b""

    def line(self, timeout: float = 20.0) -> dict:
        """The next JSON line the child prints; fails the test after `timeout`."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no output from child within {timeout}s; stderr: {self.stderr()}")
            ready, _, _ = select.select([self.popen.stdout], [], [], left)
            if ready:
                chunk = os.read(self.popen.stdout.fileno(), 65536)
                if not chunk:
                    raise AssertionError(f"child exited ({self.popen.wait()}); stderr: {self.stderr()}")
                self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(raw)

    def wait(self, timeout: float = 20.0) -> int:
        return self.popen.wait(timeout=timeout)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stderr(self) -> str:
        if self.popen.poll() is None:
            return "(still running)"
        return self.popen.stderr.read().decode(errors="replace")[-4000:]


@pytest.fixture
def spawn():
    """Start the program `tests/programs/<name>.py` as a child; killed at teardown. It runs
    with the project and tests/ on its PYTHONPATH, so it may import `helpers.*`."""
    children: list[Proc] = []

    def start(name: str, *args: str, env: dict | None = None) -> Proc:
        cmd = [sys.executable, str(PROGRAMS / f"{name}.py"), *map(str, args)]
        full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)]), **(env or {})}
        proc = Proc(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     stdin=subprocess.DEVNULL, env=full_env))
        children.append(proc)
        return proc

    yield start
    for child in children:
        if child.popen.poll() is None:
            child.popen.kill()
        child.popen.wait(timeout=10)


@pytest.fixture
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def containers():
    """The container tier (tests/containers/): the machine prepared for podman once, and the
    project's image built from its own Dockerfile (tests/helpers/containers.py says how)."""
    from helpers.containers import IMAGE, Containers, environment

    tier = Containers(environment())
    tier.podman("build", "--quiet", "-t", IMAGE, "--build-arg",
                f"TORCH_INDEX_URL={tier.env['OFFLOOP_TORCH_INDEX_URL']}", str(ROOT), timeout=1200)
    return tier
