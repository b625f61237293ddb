"""Run discovery: a run directory's run.json names the run's endpoints.

Promise: run.json is always whole (written to a temporary file, then renamed), and
a run is found by its directory, its name under a runs root, or its state endpoint.
"""

from __future__ import annotations

import json
import os
import re
import socket
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from offloop.bus.errors import RunNotFound

__all__ = [
    "RunInfo",
    "RUN_FILE",
    "default_runs_root",
    "write_run_info",
    "read_run_info",
    "mark_finished",
    "find_run",
    "list_runs",
    "pid_alive",
    "at_host",
]

RUN_FILE = "run.json"


@dataclass
class RunInfo:
    """What another process needs to find and talk to a run."""

    run_id: str
    run_name: str
    pid: int
    started: float
    endpoints: dict[str, str]
    host: str = field(default_factory=socket.gethostname)
    finished: bool = False
    run_dir: str = ""
    world_size: int = 1
    ranks: list[dict[str, str]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    #: the trainer's CURVE public key (z85), when its sockets need keys; public, not secret
    curve_public: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "run info") -> RunInfo:
        known = {f for f in cls.__dataclass_fields__}
        missing = [k for k in ("run_id", "run_name", "pid", "started", "endpoints")
                   if k not in data]
        if missing:
            raise RunNotFound(f"{where} lacks {', '.join(missing)}")
        return cls(**{k: v for k, v in data.items() if k in known})


def default_runs_root() -> Path:
    """$OFFLOOP_RUNS, or ./runs."""
    return Path(os.environ.get("OFFLOOP_RUNS", "runs"))


def write_run_info(run_dir: str | os.PathLike, info: RunInfo) -> Path:
    """Write run.json atomically and durably; the directory is created owner-only. The
    temporary files of run.json writes that were killed (their process is gone) go first."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    info.run_dir = str(run_dir.resolve())
    remove_stale_temporaries(run_dir, RUN_FILE)
    return write_json_atomically(run_dir / RUN_FILE, info.to_dict(), indent=2, sort_keys=True)


def write_json_atomically(target: Path, data: Any, **dump: Any) -> Path:
    """`data` as JSON in `target`, all or nothing: written to a temporary file beside it
    (named for its writer's pid, so one a killed writer left is known as such), fsynced,
    renamed over it, and the folder fsynced: a reader never sees half a file, and after a
    power cut the new name is there."""
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.pid{os.getpid()}.", suffix=".tmp",
                               dir=target.parent)
    try:
        with os.fdopen(fd, "w") as out:
            json.dump(data, out, **dump)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_folder(target.parent)
    return target


def fsync_folder(folder: Path) -> None:
    """Make the names in `folder` (a rename into it) durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: the temporary file of an atomic write: ``.<name>.pid<writer's pid>.<random>.tmp``
_TEMPORARY = re.compile(r"^\.(.+)\.pid(\d+)\..+\.tmp$")


def remove_stale_temporaries(folder: Path, name: str | None = None) -> list[str]:
    """Remove the temporary files of atomic writes (of `name` only, if given) whose writer
    is gone: one killed mid-write (SIGKILL, a power cut) leaves one. A live writer's are
    kept. The names removed."""
    removed = []
    try:
        entries = list(folder.iterdir())
    except OSError:  # no folder yet, or not readable: nothing of ours there
        return removed
    for entry in entries:
        match = _TEMPORARY.match(entry.name)
        if (match is None or (name is not None and match.group(1) != name)
                or pid_alive(int(match.group(2)))):
            continue
        entry.unlink(missing_ok=True)
        removed.append(entry.name)
    return removed


def read_run_info(run_dir: str | os.PathLike) -> RunInfo:
    path = Path(run_dir) / RUN_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise RunNotFound(f"{run_dir} is not a run directory: it has no {RUN_FILE}") from None
    except (OSError, ValueError) as exc:
        raise RunNotFound(f"{path} cannot be read: {exc}") from None
    if not isinstance(data, dict):
        raise RunNotFound(f"{path} does not hold a JSON object")
    return RunInfo.from_dict(data, str(path))


def mark_finished(run_dir: str | os.PathLike, **extra: Any) -> None:
    """Set `finished`, and merge `extra` (final progress, say) into run.json's extra."""
    info = read_run_info(run_dir)
    info.finished = True
    info.extra.update(extra)
    write_run_info(run_dir, info)


def find_run(spec: str, runs_root: str | os.PathLike | None = None, timeout: float = 2.0,
             curve=None) -> RunInfo:
    """A run from a directory, a name under `runs_root`, or a ``tcp://`` state endpoint
    (asked with `curve` client keys when the run has keys)."""
    if "://" in spec:
        return _ask_endpoint(spec, timeout, curve)
    path = Path(spec)
    if (path / RUN_FILE).exists():
        return read_run_info(path)
    root = Path(runs_root) if runs_root is not None else default_runs_root()
    if (root / spec / RUN_FILE).exists():
        return read_run_info(root / spec)
    names = sorted(p.parent.name for p in root.glob(f"*/{RUN_FILE}")) if root.is_dir() else []
    hint = f"runs under {root}: {', '.join(names)}" if names else f"no runs under {root}"
    raise RunNotFound(f"no run {spec!r}: not a run directory, nor a run name ({hint})")


def list_runs(runs_root: str | os.PathLike | None = None) -> list[RunInfo]:
    root = Path(runs_root) if runs_root is not None else default_runs_root()
    if not root.is_dir():
        return []
    runs = []
    for path in sorted(root.glob(f"*/{RUN_FILE}")):
        try:
            runs.append(read_run_info(path.parent))
        except RunNotFound:
            continue
    return sorted(runs, key=lambda r: r.started)


def _ask_endpoint(endpoint: str, timeout: float, curve=None) -> RunInfo:
    import zmq

    from offloop.bus.wire import WireError, decode_reply, encode_request

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    if curve is not None:
        curve.apply(sock)
    try:
        sock.connect(endpoint)
        sock.send(encode_request("info_req"))
        if not sock.poll(timeout * 1000):
            raise RunNotFound(f"no run answered at {endpoint} within {timeout:g}s")
        try:
            reply = decode_reply(sock.recv())
        except WireError as exc:
            raise RunNotFound(
                f"{endpoint} answered with something that is not a run: {exc}") from None
    except zmq.ZMQError as exc:
        raise RunNotFound(f"cannot reach {endpoint}: {exc}") from None
    finally:
        sock.close(linger=0)
    if reply["k"] != "info":
        raise RunNotFound(f"{endpoint} answered {reply['k']!r}: {reply.get('error', '')}")
    info = RunInfo.from_dict(reply["run"], endpoint)
    # a trainer bound to every interface (0.0.0.0) names its endpoints by that wildcard;
    # from elsewhere they are reached at the host this endpoint was reached at
    host = endpoint.split("://", 1)[-1].rsplit(":", 1)[0]
    info.endpoints = {k: at_host(v, host) for k, v in info.endpoints.items()}
    info.ranks = [{k: at_host(v, host) for k, v in eps.items()} for eps in info.ranks]
    return info


def at_host(endpoint: str, host: str) -> str:
    """An endpoint bound to every interface (0.0.0.0, *, ::) as reached at `host`; any
    other endpoint as it is."""
    for wildcard in ("tcp://0.0.0.0:", "tcp://*:", "tcp://[::]:"):
        if isinstance(endpoint, str) and endpoint.startswith(wildcard):
            return f"tcp://{host}:{endpoint[len(wildcard):]}"
    return endpoint


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists on this host (another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
