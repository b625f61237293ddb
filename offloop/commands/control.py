"""`offloop halt` and `offloop checkpoint`: ask a run, print the ack.

Exit 0 with the ack; 1 when the run is unknown, finished, unreachable, silent past
the timeout, or refuses.
"""

from __future__ import annotations

import argparse
import os
import socket
import uuid

from offloop.errors import abort


def add_halt_arguments(parser: argparse.ArgumentParser) -> None:
    _common(parser)
    parser.add_argument("--reason", default="offloop halt", help="recorded in fit_end's stopped_by")


def add_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    _common(parser)
    parser.add_argument("--tag", default="", help="appended to the checkpoint's file name")


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="run directory, run name (under --runs-root) or state endpoint tcp://host:port")
    parser.add_argument("--runs-root", help="where run names are looked up (default $OFFLOOP_RUNS or ./runs)")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the ack")
    parser.add_argument("--keys", default=os.environ.get("OFFLOOP_KEYS"),
                        help="keys folder (from `offloop keys`) for a run that has keys ($OFFLOOP_KEYS)")
    parser.add_argument("--key-name", default="client", help="which client key pair in --keys")


def run_halt(args: argparse.Namespace) -> int:
    ack = _ask(args, "halt", {"reason": args.reason})
    print(f"halted run {args.run_name} after batch {ack.result.get('step')} "
          f"(epoch {ack.result.get('epoch')})")
    return 0


def run_checkpoint(args: argparse.Namespace) -> int:
    ack = _ask(args, "checkpoint", {"tag": args.tag})
    print(f"checkpoint of run {args.run_name} at batch {ack.result.get('step')}: {ack.result.get('path')}")
    return 0


def _ask(args: argparse.Namespace, op: str, request_args: dict):
    from offloop.bus import BusError, ControlClient, ControlTimeout, find_run
    from offloop.bus.discovery import pid_alive
    from offloop.bus.security import client_keys_for, endpoint_keys

    try:
        info = find_run(args.run, args.runs_root, curve=endpoint_keys(args.run, args.keys, args.key_name))
        curve = client_keys_for(info, args.keys, args.key_name)
    except BusError as exc:
        abort(str(exc), 1)
    args.run_name = info.run_name
    if info.finished:
        abort(f"run {info.run_name} has finished; there is nothing to {op}", 1)
    endpoint = info.endpoints.get("control")
    if not endpoint:
        abort(f"run {info.run_name} has no control endpoint (not rank 0, or publishing is off)", 1)
    if info.host == socket.gethostname() and "://" not in args.run and not pid_alive(info.pid):
        abort(f"run {info.run_name} is not running: its process {info.pid} is gone "
              "(it ended without marking run.json finished)", 1)
    # unique per invocation: a reused pid must never be answered with an earlier run's stored ack
    client_id = f"cli-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    client = ControlClient(endpoint, client_id=client_id, curve=curve)
    try:
        ack = client.request(op, request_args, timeout=args.timeout)
    except ControlTimeout:
        hint = (" (a run with keys never answers a client whose key it has not authorised: "
                "check --keys and --key-name)") if info.curve_public else ""
        abort(f"run {info.run_name} did not answer at {endpoint} within {args.timeout:g}s{hint}", 1)
    except BusError as exc:
        abort(f"run {info.run_name}: {exc}", 1)
    finally:
        client.close()
    if not ack.ok:
        abort(f"run {info.run_name} refused the {op}: {ack.error}", 1)
    return ack

