"""`offloop keys DIR [--client NAME] [--role monitor|control]`: CURVE key pairs for a trainer
and its clients, each client authorised with a role (run it again to change one)."""

from __future__ import annotations

import argparse

from offloop.errors import abort


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("folder", help="where keys go (created owner-only)")
    parser.add_argument("--client", default="client",
                        help="name of the client key pair to create and authorise (default: client)")
    parser.add_argument("--role", choices=("monitor", "control"), default="control",
                        help="monitor: events, state and run info; control: halt and checkpoint too "
                             "(default: control). A running trainer applies a change at once.")


def run(args: argparse.Namespace) -> int:
    from offloop.bus.security import SecurityError, generate_keys

    try:
        paths = generate_keys(args.folder, args.client, args.role)
    except (SecurityError, OSError) as exc:
        abort(str(exc))
    print(f"trainer key pair   {paths['trainer']}  (Trainer(keys=...), offloop demo --keys)")
    print(f"client key pair    {paths['client']}  (give to the client: --keys {args.folder} "
          f"--key-name {args.client}), authorised as {args.role}")
    print(f"authorised clients {paths['authorized']}/  (one public key and role per file; remove one "
          "to revoke it, even while a trainer runs)")
    return 0
