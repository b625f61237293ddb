"""`offloop keys DIR [--client NAME]`: CURVE key pairs for a trainer and its clients."""

from __future__ import annotations

import argparse

from offloop.errors import abort


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("folder", help="where keys go (created owner-only)")
    parser.add_argument("--client", default="client",
                        help="name of the client key pair to create and authorise (default: client)")


def run(args: argparse.Namespace) -> int:
    from offloop.bus.security import SecurityError, generate_keys

    try:
        paths = generate_keys(args.folder, args.client)
    except (SecurityError, OSError) as exc:
        abort(str(exc))
    print(f"trainer key pair   {paths['trainer']}  (Trainer(keys=...), offloop demo --keys)")
    print(f"client key pair    {paths['client']}  (give to the client: --keys {args.folder} "
          f"--key-name {args.client})")
    print(f"authorised clients {paths['authorized']}/  (one public key per file; remove to revoke)")
    return 0
