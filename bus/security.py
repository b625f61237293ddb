"""CURVE keys for the bus: generate them, load them, and admit only listed clients.

Pattern: CurveZMQ with a ZAP handler (pyzmq's ThreadAuthenticator). Promise: with
keys, every socket a trainer binds is a CURVE server, and only clients whose public
key sits in the keys folder's `authorized/` directory complete a handshake; a
trainer never listens beyond loopback without keys unless told `insecure`.

Keys folder layout (`offloop keys DIR` writes it)::

    DIR/trainer.key           trainer public key   (give to clients; also in run.json)
    DIR/trainer.key_secret    trainer secret key   (stays with the trainer)
    DIR/<name>.key_secret     a client's key pair  (give to that client only)
    DIR/authorized/<name>.key the public keys the trainer admits
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

from offloop.bus.errors import BusError

__all__ = ["SecurityError", "ServerKeys", "ClientKeys", "generate_keys", "load_server_keys",
           "load_client_keys", "is_loopback", "check_exposure", "endpoint_keys", "client_keys_for"]


class SecurityError(BusError):
    """Missing or unusable keys, or a bind that would expose an unauthenticated socket."""


@dataclass(frozen=True)
class ServerKeys:
    public: bytes
    secret: bytes
    authorized: Path

    def apply(self, sock: zmq.Socket) -> None:
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True

    def start_authenticator(self, context: zmq.Context):
        """The ZAP handler for `context`: admits only keys in `authorized/`."""
        from zmq.auth.thread import ThreadAuthenticator

        auth = ThreadAuthenticator(context)
        auth.start()
        auth.configure_curve(domain="*", location=str(self.authorized))
        return auth


@dataclass(frozen=True)
class ClientKeys:
    public: bytes
    secret: bytes
    server: bytes

    def apply(self, sock: zmq.Socket) -> None:
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_serverkey = self.server


def generate_keys(folder: str | os.PathLike, client: str = "client") -> dict[str, Path]:
    """Create the trainer's key pair (once) and a client key pair named `client`,
    and authorise that client. Secret files are readable by the owner only."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(folder, 0o700)
    authorized = folder / "authorized"
    authorized.mkdir(exist_ok=True, mode=0o700)
    if not _safe_name(client):
        raise SecurityError(f"client name {client!r} must be letters, digits, '-' or '_'")
    if client == "trainer":
        raise SecurityError("'trainer' is the trainer's own key; pick another client name")
    paths = {}
    if not (folder / "trainer.key_secret").exists():
        zmq.auth.create_certificates(str(folder), "trainer")
    paths["trainer"] = folder / "trainer.key_secret"
    if not (folder / f"{client}.key_secret").exists():
        zmq.auth.create_certificates(str(folder), client)
    shutil.copy(folder / f"{client}.key", authorized / f"{client}.key")
    for secret in folder.glob("*.key_secret"):
        os.chmod(secret, 0o600)
    paths["client"] = folder / f"{client}.key_secret"
    paths["authorized"] = authorized
    return paths


def _safe_name(name: str) -> bool:
    return bool(name) and all(c.isalnum() or c in "-_" for c in name)


def load_server_keys(folder: str | os.PathLike) -> ServerKeys:
    folder = Path(folder)
    public, secret = _load(folder / "trainer.key_secret", "the trainer's key pair")
    if not secret:
        raise SecurityError(f"{folder / 'trainer.key_secret'} has no secret key")
    authorized = folder / "authorized"
    if not authorized.is_dir():
        raise SecurityError(f"{authorized} is missing: run `offloop keys {folder}` to authorise a client")
    return ServerKeys(public, secret, authorized)


def load_client_keys(folder: str | os.PathLike, client: str = "client",
                     server_public: str | bytes | None = None) -> ClientKeys:
    """A client's keys; the trainer's public key comes from the folder or from run.json."""
    folder = Path(folder)
    public, secret = _load(folder / f"{client}.key_secret", f"client key pair {client!r}")
    if not secret:
        raise SecurityError(f"{folder / (client + '.key_secret')} has no secret key")
    if server_public is None:
        server_public, _ = _load(folder / "trainer.key", "the trainer's public key")
    if isinstance(server_public, str):
        server_public = server_public.encode()
    return ClientKeys(public, secret, server_public)


def _load(path: Path, what: str) -> tuple[bytes, bytes | None]:
    try:
        return zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as exc:
        raise SecurityError(f"cannot load {what} from {path}: {exc}; create keys with "
                            f"`offloop keys {path.parent}`") from None


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        except OSError:
            return False


def check_exposure(host: str, keys: ServerKeys | None, insecure: bool) -> None:
    """Refuse to listen beyond loopback without keys, unless explicitly insecure."""
    if keys is None and not insecure and not is_loopback(host):
        raise SecurityError(
            f"refusing to listen on {host!r} without keys: anyone who can reach it could halt "
            "the run. Create keys with `offloop keys DIR` and pass keys=DIR (or --keys DIR), "
            "or pass insecure=True (--insecure) to accept the risk.")


def endpoint_keys(spec: str, keys: str | None, key_name: str = "client") -> ClientKeys | None:
    """Keys for asking a tcp:// endpoint about its run (the trainer's public key must then
    be in the keys folder, since there is no run.json to read it from)."""
    if not keys or "://" not in str(spec):
        return None
    return load_client_keys(keys, key_name)


def client_keys_for(info, keys: str | None, key_name: str = "client") -> ClientKeys | None:
    """The client keys to talk to this run with: none if it has none, else ours."""
    if not info.curve_public:
        return None
    if not keys:
        raise SecurityError(f"run {info.run_name} has keys: pass --keys DIR (a folder made by "
                            "`offloop keys`, holding your client key)")
    return load_client_keys(keys, key_name, info.curve_public)
