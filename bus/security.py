"""CURVE keys for the bus: generate them, load them, and admit only listed clients.

Pattern: CurveZMQ with a ZAP handler (pyzmq's ThreadAuthenticator). Promise: with
keys, every socket a trainer binds is a CURVE server, and only clients whose public
key sits in the keys folder's `authorized/` directory complete a handshake; a
trainer never listens beyond loopback without keys unless told `insecure`.

Keys folder layout (`offloop keys DIR` writes it)::

    DIR/trainer.key           trainer public key   (give to clients; also in run.json)
    DIR/trainer.key_secret    trainer secret key   (stays with the trainer)
    DIR/<name>.key_secret     a client's key pair  (give to that client only)
    DIR/authorized/<name>.key the public keys the trainer admits, each with its role

A role is `monitor` (events, late-join state, run info) or `control` (halt and
checkpoint too); a key file without one is `control`, as every key was before roles.
The trainer reads `authorized/` again whenever it changes: a key removed (or turned
into a monitor) is refused from its next request on, and its events connection is
cut (see `Publisher`). The trainer's own callback workers get a key pair made in
memory for the run, which no file can revoke or re-admit.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth

from offloop.bus.errors import BusError

__all__ = ["SecurityError", "ServerKeys", "ClientKeys", "AuthorizedKeys", "ROLES", "CONTROL_OPS",
           "generate_keys", "load_server_keys", "load_client_keys", "is_loopback", "check_exposure",
           "endpoint_keys", "client_keys_for"]

log = logging.getLogger("offloop.bus")

#: what a client key may do: a monitor reads (events, state, run info); control may also
#: send the requests in CONTROL_OPS
ROLES = ("monitor", "control")
CONTROL_OPS = frozenset({"halt", "checkpoint"})


class SecurityError(BusError):
    """Missing or unusable keys, or a bind that would expose an unauthenticated socket."""


class AuthorizedKeys:
    """Who may connect, and with which role: the keys in `authorized/`, read again whenever
    the folder changes, plus keys admitted in memory (`admit_new`). Used from the ZAP
    handler's thread and the sockets' service threads, so every read takes a lock.

    A request names its key by the User-Id the ZAP handler gave its connection (pyzmq's:
    the key, z85-encoded), so a request on a connection made before a revocation is
    judged by the folder as it is now."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        #: keys that lost their role (removed, or turned from control to monitor) since start
        self.revocations = 0
        self._lock = threading.Lock()
        self._in_memory: dict[str, tuple[str, str]] = {}
        self._files: dict[str, tuple[str, str]] = {}  # z85 key -> (name, role)
        self._signature: tuple | None = None
        self.refresh()

    def admit_new(self, name: str, role: str = "control") -> tuple[bytes, bytes]:
        """A key pair made now and admitted for this process's life only: (public, secret)."""
        _check_role(role)
        public, secret = zmq.curve_keypair()
        with self._lock:
            self._in_memory[public.decode()] = (name, role)
        return public, secret

    def refresh(self) -> bool:
        """Read `authorized/` again if it changed; True when a key lost its role since."""
        try:
            signature = tuple(sorted((e.name, e.inode(), e.stat().st_mtime_ns, e.stat().st_size)
                                     for e in os.scandir(self.folder) if e.name.endswith(".key")))
        except OSError as exc:
            # unreadable: no file key is admitted until it is readable again
            signature = (str(exc),)
        with self._lock:
            if signature == self._signature:
                return False
            self._signature = signature
            before, self._files = self._files, _read_authorized(self.folder)
            lost = [name for key, (name, role) in before.items()
                    if key not in self._files
                    or (role == "control" and self._files[key][1] != "control")]
            self.revocations += len(lost)
        for name in lost:
            log.warning("offloop: client key %r lost its role (removed from, or changed in, %s): "
                        "its requests are refused and its connections cut", name, self.folder)
        return bool(lost)

    def who(self, user_id: str | None) -> tuple[str, str] | None:
        """(name, role) of the key a connection authenticated with, as the folder is now."""
        self.refresh()
        with self._lock:
            return self._in_memory.get(user_id or "") or self._files.get(user_id or "")

    def refusal(self, user_id: str | None, op: str | None = None) -> str | None:
        """Why the key behind `user_id` may not make this request (None: it may); `op` is
        a control op, or None for reading (events, state, run info)."""
        found = self.who(user_id)
        if found is None:
            return ("this client's key is no longer authorised by the trainer "
                    "(it was removed from authorized/)")
        name, role = found
        if op in CONTROL_OPS and role != "control":
            return (f"key {name!r} is authorised as {role}: {op} needs a control key "
                    f"(`offloop keys DIR --client {name} --role control`)")
        return None

    def callback(self, domain: str, key: bytes) -> bool:
        """pyzmq's CURVE credentials provider: whether a handshake with `key` (z85) succeeds."""
        return self.who(key.decode()) is not None


@dataclass(frozen=True)
class ServerKeys:
    public: bytes
    secret: bytes
    authorized: Path
    access: AuthorizedKeys = field(compare=False, repr=False, default=None)

    def apply(self, sock: zmq.Socket) -> None:
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True

    def start_authenticator(self, context: zmq.Context):
        """The ZAP handler for `context`: admits only keys `access` admits now."""
        from zmq.auth.thread import ThreadAuthenticator

        auth = ThreadAuthenticator(context)
        auth.start()
        auth.configure_curve_callback(domain="*", credentials_provider=self.access)
        return auth

    def client_keys(self, name: str, role: str = "control") -> ClientKeys:
        """A client key pair admitted in memory for this run (the trainer's own workers)."""
        public, secret = self.access.admit_new(name, role)
        return ClientKeys(public, secret, self.public)


@dataclass(frozen=True)
class ClientKeys:
    public: bytes
    secret: bytes
    server: bytes

    def apply(self, sock: zmq.Socket) -> None:
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_serverkey = self.server


def generate_keys(folder: str | os.PathLike, client: str = "client",
                  role: str = "control") -> dict[str, Path]:
    """Create the trainer's key pair (once) and a client key pair named `client` (once),
    and authorise that client as `role` (again, if it was: its role changes). Secret
    files are readable by the owner only."""
    _check_role(role)
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
    public, _ = _load(folder / f"{client}.key", f"client key {client!r}")
    _write_authorized(authorized / f"{client}.key", public, role)
    for secret in folder.glob("*.key_secret"):
        os.chmod(secret, 0o600)
    paths["client"] = folder / f"{client}.key_secret"
    paths["authorized"] = authorized
    return paths


def _safe_name(name: str) -> bool:
    return bool(name) and all(c.isalnum() or c in "-_" for c in name)


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise SecurityError(f"role {role!r} is not one of {', '.join(ROLES)}")


def _write_authorized(path: Path, public: bytes, role: str) -> None:
    """A public key file as zmq.auth writes them, with the role in its metadata; replaced
    in one rename, so the trainer never reads half of it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text('# offloop: a client key the trainer admits, and its role\n'
                   f'metadata\n    role = "{role}"\n'
                   f'curve\n    public-key = "{public.decode()}"\n')
    os.replace(tmp, path)


def _read_authorized(folder: Path) -> dict[str, tuple[str, str]]:
    """{z85 public key: (name, role)} of the key files in `folder`; a file that cannot be
    read, or names an unknown role, admits nobody (logged)."""
    keys: dict[str, tuple[str, str]] = {}
    if not folder.is_dir():
        log.warning("offloop: %s is not a folder of authorised keys: admitting none", folder)
        return keys
    for path in sorted(folder.glob("*.key")):
        try:
            public, _ = zmq.auth.load_certificate(str(path))
            role = _role_in(path.read_text())
            _check_role(role)
        except (OSError, ValueError, SecurityError) as exc:
            log.warning("offloop: authorised key %s is ignored: %s", path, exc)
            continue
        keys[public.decode()] = (path.stem, role)
    return keys


def _role_in(text: str) -> str:
    """The `role = "..."` of a key file's metadata section; `control` when it has none."""
    for line in text.splitlines():
        name, sep, value = line.strip().partition("=")
        if sep and name.strip() == "role":
            return value.strip().strip('"')
    return "control"


def load_server_keys(folder: str | os.PathLike) -> ServerKeys:
    folder = Path(folder)
    public, secret = _load(folder / "trainer.key_secret", "the trainer's key pair")
    if not secret:
        raise SecurityError(f"{folder / 'trainer.key_secret'} has no secret key")
    authorized = folder / "authorized"
    if not authorized.is_dir():
        raise SecurityError(f"{authorized} is missing: run `offloop keys {folder}` to authorise "
                            "a client")
    return ServerKeys(public, secret, authorized, AuthorizedKeys(authorized))


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
