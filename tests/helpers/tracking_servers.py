"""Real experiment trackers for the logger tests, read back from where they store runs:
an `mlflow server` process on a sqlite file, and a wandb offline run's `.wandb` file.

Every wait has a deadline; the server's log is in the failure message.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from helpers.prometheus_server import free_port, stop

__all__ = ["MlflowServer", "wandb_records", "wandb_history"]


class MlflowServer:
    """`with MlflowServer(tmp_path) as server:` — `mlflow server` with a sqlite backend and
    a local artifact root, on a free loopback port; `server.url` is its tracking URI."""

    def __init__(self, workdir: Path, timeout: float = 90.0) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = self.workdir / "mlflow-server.log"
        self.timeout = timeout
        mlflow = shutil.which("mlflow", path=str(Path(sys.executable).parent)) or shutil.which("mlflow")
        assert mlflow, "the tests need mlflow: pip install 'offloop[mlflow]'"
        self._cmd = [mlflow, "server", "--backend-store-uri", f"sqlite:///{self.workdir / 'mlflow.db'}",
                     "--default-artifact-root", str(self.workdir / "artifacts"),
                     "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"]
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> MlflowServer:
        with self.log.open("wb") as log:
            self._proc = subprocess.Popen(self._cmd, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + self.timeout
        while True:
            assert self._proc.poll() is None, f"mlflow server exited: {self.log.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return self
            except OSError:
                pass
            assert time.monotonic() < deadline, (f"mlflow server not up after {self.timeout}s: "
                                                 f"{self.log.read_text()[-3000:]}")
            time.sleep(0.2)

    def __exit__(self, *exc: object) -> None:
        stop(self._proc)


# wandb's run file: a 7-byte header (":W&B", magic 0xBEE1, version), then LevelDB's log
# format — 32 KiB blocks of chunks, each (crc32, length, type) then bytes; a record is one
# FULL chunk or FIRST, MIDDLE..., LAST. Each record is a wandb_internal_pb2.Record.
_BLOCK, _CHUNK_HEADER = 32768, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def wandb_records(run_file: Path) -> list[Any]:
    """Every record of an offline run's `run-*.wandb` file, parsed."""
    from wandb.proto import wandb_internal_pb2

    data = Path(run_file).read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1), f"{run_file} is not a wandb run file"
    position, pending, records = 7, b"", []
    while position + _CHUNK_HEADER <= len(data):
        left = _BLOCK - position % _BLOCK
        if left < _CHUNK_HEADER:  # a block's tail too short for a chunk header is padding
            position += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[position:position + _CHUNK_HEADER])
        if kind == 0:  # zeroes up to the block's end
            position += left
            continue
        pending += data[position + _CHUNK_HEADER:position + _CHUNK_HEADER + length]
        position += _CHUNK_HEADER + length
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_history(records: list[Any]) -> list[dict[str, Any]]:
    """The run's history rows (one per `run.log` step), values decoded from JSON."""
    rows = []
    for record in records:
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows
