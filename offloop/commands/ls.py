"""`offloop ls`: runs under a runs root, live or finished, with their progress."""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runs-root", help="default $OFFLOOP_RUNS or ./runs")
    parser.add_argument("--json", action="store_true", help="one JSON object per run")
    parser.add_argument("--keys", default=os.environ.get("OFFLOOP_KEYS"),
                        help="keys folder (from `offloop keys`), to read the progress of runs "
                             "that have keys ($OFFLOOP_KEYS)")
    parser.add_argument("--key-name", default="client", help="which client key pair in --keys")


def run(args: argparse.Namespace) -> int:
    import json

    from offloop.bus import default_runs_root, list_runs

    root = os.path.abspath(args.runs_root or default_runs_root())
    runs = list_runs(root)
    if not runs:
        print(f"no runs under {root}", file=sys.stderr if args.json else sys.stdout)
        return 0
    rows = [_row(info, args.keys, args.key_name) for info in runs]
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    print(f"runs under {root}:")
    headers = ["NAME", "STATUS", "PROGRESS", "STARTED", "DIRECTORY"]
    table = [[r["name"], r["status"], r["progress"], r["started"], r["run_dir"]] for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *table, strict=False)]
    for line in [headers, *table]:
        print("  ".join(str(cell).ljust(w) for cell, w in zip(line, widths, strict=False)).rstrip())
    return 0


def _row(info, keys: str | None, key_name: str) -> dict:
    status = "finished" if info.finished else live_status(info)
    progress = None
    if info.finished:
        progress = info.extra.get("progress")
    elif status == "live":
        progress = _live_progress(info, keys, key_name)
    return {
        "name": info.run_name, "status": status,
        "progress": _describe(progress, info.extra.get("config", {}).get("max_duration")),
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.started)),
        "run_dir": info.run_dir,
    }


def live_status(info) -> str:
    """An unfinished run's status: live (its process is here), dead (gone), or live? (another host)."""
    if info.host != socket.gethostname():
        return "live?"
    from offloop.bus.discovery import pid_alive

    return "live" if pid_alive(info.pid) else "dead"


def _live_progress(info, keys: str | None, key_name: str) -> dict | None:
    """The latest batch_end from the run's late-join state (a quick request); None when
    it cannot be had (a run with keys and no --keys, say)."""
    import zmq

    from offloop.bus.security import SecurityError, client_keys_for
    from offloop.bus.wire import decode_event, decode_reply, encode_request

    endpoint = info.endpoints.get("state")
    if not endpoint:
        return None
    try:
        curve = client_keys_for(info, keys, key_name)
    except SecurityError:
        return None
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    if curve is not None:
        curve.apply(sock)
    try:
        sock.connect(endpoint)
        sock.send(encode_request("state_req", topics=["batch_end", "epoch_end"]))
        if not sock.poll(1000):
            return None
        frames = sock.recv_multipart()
        header = decode_reply(frames[0])
        at, latest = 1, None
        for count in header.get("entries", []):
            msg = decode_event(frames[at:at + count])
            at += count
            latest = msg if latest is None or msg.seq > latest.seq else latest
        if latest is None:
            return None
        epoch, batch, _, sample, token = latest.ts
        return {"epoch": epoch, "batch": batch, "sample": sample, "token": token}
    except Exception:
        return None
    finally:
        sock.close(linger=0)


def _describe(progress: dict | None, max_duration: str | None) -> str:
    if not progress:
        return "-"
    text = f"ep {progress['epoch']} ba {progress['batch']}"
    return f"{text} / {max_duration}" if max_duration else text
