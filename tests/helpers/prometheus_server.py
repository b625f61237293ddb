"""A real Prometheus server for tests: Debian's `prometheus`, on a free loopback port.

Every wait has a deadline; a missing binary fails (never skips) with the command that
installs it.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

__all__ = ["Prometheus", "free_port", "scrape_config", "scrape", "stop"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(proc: subprocess.Popen | None) -> None:
    """Terminate a server process the test started, and kill it if it will not go."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def scrape_config(targets: list[str], interval: str = "500ms", job: str = "offloop") -> str:
    """A prometheus.yml scraping `targets` (host:port) every `interval`."""
    listed = ", ".join(json.dumps(t) for t in targets)
    return (f"global:\n  scrape_interval: {interval}\n  scrape_timeout: {interval}\n"
            f"scrape_configs:\n  - job_name: {job}\n    static_configs:\n      - targets: [{listed}]\n")


def scrape(url: str, timeout: float = 2.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


class Prometheus:
    """`with Prometheus(tmp_path, config_text) as prom:` — started, its targets discovered
    (Prometheus hands discovered targets to its scrapers only every 5 s), then stopped."""

    def __init__(self, workdir: Path, config: str, targets: int = 1, *, host: str = "127.0.0.1",
                 launcher: list[str] | None = None) -> None:
        """`host`: the address it listens on; `launcher`: a command prefix it runs under
        (`ip netns exec NS`, for a Prometheus on a host of its own)."""
        binary = shutil.which("prometheus")
        assert binary, ("the tests need Debian's `prometheus` (2.42): run `make system-deps` "
                        "(scripts/system-deps.sh) or `apt-get install prometheus`")
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_file = self.workdir / "prometheus.yml"
        self.config_file.write_text(config)
        self.port = free_port()
        self.url = f"http://{host}:{self.port}"
        self.log = self.workdir / "prometheus.log"
        self._cmd = [*(launcher or []), binary, f"--config.file={self.config_file}",
                     f"--storage.tsdb.path={self.workdir / 'data'}",
                     f"--web.listen-address={host}:{self.port}", "--log.level=warn"]
        self._targets = targets
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> Prometheus:
        with self.log.open("wb") as log:
            self._proc = subprocess.Popen(self._cmd, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL)
        self._wait_ready(timeout=30)
        deadline = time.monotonic() + 20
        while len(self.api("targets")["activeTargets"]) < self._targets:
            assert time.monotonic() < deadline, f"prometheus found no targets in 20s: {self.logs()}"
            time.sleep(0.1)
        return self

    def __exit__(self, *exc: object) -> None:
        stop(self._proc)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self._proc.poll() is None, f"prometheus exited ({self._proc.returncode}): {self.logs()}"
            try:
                scrape(f"{self.url}/-/ready", timeout=1)
                return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            assert time.monotonic() < deadline, f"prometheus not ready after {timeout}s: {self.logs()}"
            time.sleep(0.1)

    def logs(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def api(self, path: str, **params: Any) -> Any:
        """GET /api/v1/<path>; returns `data`, failing the test on an error status."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            body = json.loads(scrape(url, timeout=5))
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read() or b"{}")
        assert body.get("status") == "success", f"{url}: {body}"
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """An instant query's result list."""
        return self.api("query", query=expr)["result"]

    def samples(self, selector: str, window: str = "10m") -> list[tuple[float, float]]:
        """Every raw sample (time, value) of the one series `selector` matches."""
        result = self.query(f"{selector}[{window}]")
        assert len(result) <= 1, f"{selector} matches {len(result)} series: {result}"
        return [(float(t), float(v)) for t, v in result[0]["values"]] if result else []

    def wait_for(self, expr: str, predicate, timeout: float = 30.0) -> list[dict]:
        """Poll an instant query until `predicate(result)` holds; returns that result."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(expr)
            if predicate(result):
                return result
            assert time.monotonic() < deadline, (f"{expr} never satisfied the condition in {timeout}s; "
                                                 f"last result {result}; targets "
                                                 f"{self.api('targets')['activeTargets']}")
            time.sleep(0.2)
