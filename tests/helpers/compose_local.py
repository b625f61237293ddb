"""Read docker-compose.yml as Compose does, and run its services as local processes.

`docker-compose config` (Debian's docker-compose) resolves the file: anchors, variables,
defaults. Its YAML is read with the YAML module docker-compose itself runs on, so the
suite needs no YAML package of its own. A service runs with the file's command and
environment; what only a container would provide is mapped, and nothing else changes:
service host names become 127.0.0.1, each named volume a temporary folder, the image's
working directory the checkout.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["compose_config", "read_yaml", "LocalService", "ROOT", "wait_until"]

ROOT = Path(__file__).resolve().parent.parent.parent
_YAML_TO_JSON = "import json, sys, yaml; json.dump(yaml.safe_load(sys.stdin), sys.stdout)"


def _docker_compose() -> str:
    binary = shutil.which("docker-compose")
    assert binary, ("the tests need Debian's `docker-compose`: run `make system-deps` "
                    "(scripts/system-deps.sh) or `apt-get install docker-compose`")
    return binary


def read_yaml(text: str) -> Any:
    """YAML -> Python, with the interpreter (and PyYAML) docker-compose runs on."""
    with open(_docker_compose(), "rb") as script:
        shebang = script.readline().decode().removeprefix("#!").split()
    assert shebang, "docker-compose has no #! line to find its Python from"
    done = subprocess.run([*shebang, "-c", _YAML_TO_JSON], input=text, capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def compose_config(*files: str, env: dict[str, str] | None = None) -> tuple[dict, str]:
    """(resolved config, its YAML) of the compose files, as `docker-compose config` prints it."""
    args = [_docker_compose()]
    for name in files or ("docker-compose.yml",):
        args += ["-f", str(ROOT / name)]
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OFFLOOP_", "GRAFANA_"))}
    required = {"GRAFANA_ADMIN_PASSWORD": "a-test-password"}  # compose has no default for it
    done = subprocess.run([*args, "config"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**clean, **required, **(env or {})})
    assert done.returncode == 0, f"docker-compose config failed:\n{done.stderr}"
    return read_yaml(done.stdout), done.stdout


class LocalService:
    """One compose service's command as a local process; see the module docstring."""

    def __init__(self, name: str, spec: dict, services: list[str], volumes: dict[str, Path],
                 logs: Path) -> None:
        self.name, self.spec = name, spec
        self._services = set(services)
        self._mounts = self._mount_map(spec.get("volumes", []), volumes)
        self.log = logs / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    @staticmethod
    def _mount_map(entries: list, volumes: dict[str, Path]) -> dict[str, str]:
        mounts = {}
        for entry in entries:
            source, target = (entry["source"], entry["target"]) if isinstance(entry, dict) else (
                entry.split(":")[0], entry.split(":")[1])
            mounts[target] = str(volumes[source]) if source in volumes else source
        return mounts

    def map(self, value: str, host: bool = False) -> str:
        """A command argument or environment value, as it reads outside the container;
        `host`: the value names a host (an --host/--addr option's value, a *HOST* variable)."""
        value = value.replace("$$", "$")  # Compose's escape for a literal $
        if host and value in self._services:
            return "127.0.0.1"
        for target, local in sorted(self._mounts.items(), key=lambda m: -len(m[0])):
            # the mount point as a whole path or a path's start, also inside a shell line
            value = re.sub(rf"(?<![\w./-]){re.escape(target)}(?=$|[/\s'\"])", local, value)
        return value

    def command(self) -> list[str]:
        command = self.spec["command"]
        args = command if isinstance(command, list) else command.split()
        return [self.map(arg, host=i > 0 and _names_host(args[i - 1])) for i, arg in enumerate(args)]

    def environment(self) -> dict[str, str]:
        env = self.spec.get("environment") or {}
        if isinstance(env, list):
            env = dict(item.split("=", 1) for item in env)
        bin_dir = str(Path(sys.executable).parent)
        base = {k: v for k, v in os.environ.items() if not k.startswith("OFFLOOP_")}
        return {**base, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
                "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
                **{k: self.map(str(v), host=_names_host(k)) for k, v in env.items()}}

    def start(self) -> LocalService:
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(self.command(), cwd=ROOT, env=self.environment(), stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        return self

    def healthy(self) -> bool:
        """Whether the service's compose healthcheck (its CMD, mapped as the command is)
        passes now."""
        test = self.spec["healthcheck"]["test"]
        assert test[0] == "CMD", test
        args = [self.map(arg) for arg in test[1:]]
        done = subprocess.run(args, cwd=ROOT, env=self.environment(), capture_output=True, timeout=30)
        return done.returncode == 0

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"service {self.name} still running after {timeout:.0f}s; "
                                 f"its output:\n{self.output()}") from None

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""

    def stop(self) -> None:
        """End this service's process group (its worker processes too) if it is still running."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)


def _names_host(name: str) -> bool:
    return any(word in name.lower() for word in ("host", "addr"))


def wait_until(condition, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} within {timeout:.0f}s"
        time.sleep(interval)
