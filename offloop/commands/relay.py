"""`offloop relay <run>`: forward a run's events, state and control to many monitors.

Runs until the run finishes (exit 0), or its trainer has been silent for
--give-up-after seconds (exit 3). Prints one line naming the endpoint monitors use.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import time

from offloop.errors import abort


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="run directory, run name (under --runs-root) or state endpoint tcp://host:port")
    parser.add_argument("--runs-root", help="where run names are looked up (default $OFFLOOP_RUNS or ./runs)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address monitors reach the relay at (beyond loopback only with --keys, "
                             "or --insecure)")
    for name in ("events", "state", "control"):
        parser.add_argument(f"--{name}-port", type=_port, default=0, help=f"{name} port (default: any free one)")
    parser.add_argument("--keys", default=os.environ.get("OFFLOOP_KEYS"),
                        help="keys folder (from `offloop keys`): its trainer.key_secret is the relay's own "
                             "server key and its authorized/ the monitors it admits, with their roles; "
                             "its --key-name pair is the relay's key to the trainer ($OFFLOOP_KEYS)")
    parser.add_argument("--key-name", default="relay",
                        help="the relay's client key pair in --keys, authorised by the trainer as control")
    parser.add_argument("--upstream-keys",
                        help="another keys folder for the trainer side, when the trainer's is not --keys "
                             "(--keys is still needed: a relay of a run with keys has keys of its own)")
    parser.add_argument("--insecure", action="store_true",
                        help="listen beyond loopback without keys (anyone who reaches it can halt the run); "
                             "never for a run with keys, which needs --keys")
    parser.add_argument("--announce", metavar="RUNS_ROOT",
                        help="write RUNS_ROOT/<run name>/run.json naming the relay, so `offloop ls`, "
                             "`attach`, `halt` on this host find the run by name")
    parser.add_argument("--subscriber-hwm", type=int, default=10_000,
                        help="messages queued for each monitor before its own are dropped (and counted "
                             "by it as lost); the trainer's default too")
    parser.add_argument("--heartbeat-timeout", type=float, default=10.0,
                        help="seconds without the trainer's heartbeat before the relay logs it silent")
    parser.add_argument("--give-up-after", type=float, default=300.0,
                        help="seconds of silence from the trainer after which the relay exits (3)")


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number 0-65535, got {text!r}")
    return value


def _interrupted(*_) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    import logging

    from offloop.bus import BusError, RunInfo, find_run, mark_finished, write_run_info
    from offloop.bus.relay import Relay
    from offloop.bus.security import (
        check_exposure,
        client_keys_for,
        endpoint_keys,
        load_server_keys,
    )

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    upstream_folder = args.upstream_keys or args.keys
    try:
        info = find_run(args.run, args.runs_root, curve=endpoint_keys(args.run, upstream_folder, args.key_name))
        upstream = client_keys_for(info, upstream_folder, args.key_name)
        keys = load_server_keys(args.keys) if args.keys else None
        check_exposure(args.host, keys, args.insecure)
    except BusError as exc:
        abort(str(exc))
    if info.finished:
        abort(f"run {info.run_name} has finished; there is nothing to relay")
    if args.subscriber_hwm < 1:
        abort(f"--subscriber-hwm must be at least 1, got {args.subscriber_hwm}")
    try:  # a run with keys and no --keys for the relay's own side: refused (--insecure or not)
        relay = Relay(info, host=args.host, events_port=args.events_port, state_port=args.state_port,
                      control_port=args.control_port, keys=keys, upstream=upstream,
                      subscriber_hwm=args.subscriber_hwm, heartbeat_timeout=args.heartbeat_timeout)
    except BusError as exc:
        abort(str(exc))
    try:
        endpoints = relay.start()
    except Exception as exc:  # a port in use, an address not on this host
        relay.close()
        abort(f"cannot start the relay on {args.host}: {exc}")
    announced = None
    if args.announce:
        announced = os.path.join(args.announce, info.run_name)
        # this process stands for the run on this host: `ls` sees it live while the relay runs
        write_run_info(announced, RunInfo.from_dict(relay.relayed({
            **info.to_dict(), "pid": os.getpid(), "started": time.time(), "host": socket.gethostname(),
            "run_dir": "", "extra": {}})))
    signal.signal(signal.SIGTERM, _interrupted)  # a stopped container: close, mark the announced run
    print(f"offloop relay: run {info.run_name} from {info.endpoints.get('state')} at {endpoints['state']} "
          f"(events {endpoints['events']}, control {endpoints.get('control', '-')})", file=sys.stderr, flush=True)
    try:
        why = relay.serve(give_up_after=args.give_up_after)
    except KeyboardInterrupt:
        why = "interrupted"
    finally:
        relay.close()
        if announced:
            mark_finished(announced)
    stats = relay.stats
    print(f"offloop relay: {why}; forwarded {stats.state_requests} state and {stats.control_forwarded} control "
          f"requests, refused {stats.control_refused}", file=sys.stderr, flush=True)
    return {"finished": 0, "silent": 3, "interrupted": 130}[why]
