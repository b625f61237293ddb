"""A peer that speaks ZMTP 3.0 by hand over a plain TCP socket, to do what no libzmq
socket would: hold a message half sent, open connections by the hundred."""

from __future__ import annotations

import socket


def greeting() -> bytes:
    """ZMTP 3.0's greeting: signature, version 3.0, mechanism NULL, as-server 0, filler."""
    return b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" * 32


def ready(socket_type: bytes) -> bytes:
    """The NULL mechanism's READY command, naming the peer's socket type."""
    body = b"\x05READY" + b"\x0bSocket-Type" + len(socket_type).to_bytes(4, "big") + socket_type
    return b"\x04" + bytes([len(body)]) + body


def partial(size: int) -> bytes:
    """A long message frame's header announcing `size` bytes, and size - 1 of them."""
    return b"\x02" + size.to_bytes(8, "big") + b"x" * (size - 1)


def hold_partial(endpoint: str, socket_type: bytes, size: int) -> socket.socket:
    """Connect to `endpoint` (tcp://host:port), shake hands as `socket_type` and send all
    but the last byte of a `size`-byte message; the open connection."""
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    conn = socket.create_connection((host, int(port)), timeout=10)
    conn.sendall(greeting() + ready(socket_type) + partial(size))
    return conn


def is_closed(conn: socket.socket) -> bool:
    """Whether the other side has closed `conn` already (no wait: what it sent is read
    past, and a connection still open has nothing more to say)."""
    conn.setblocking(False)
    try:
        while conn.recv(4096):
            pass
        return True
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True


def was_cut(conn: socket.socket, timeout: float = 5.0) -> bool:
    """Whether the other side closed `conn` within `timeout` (what it sent first, its
    greeting and READY, is read past)."""
    conn.settimeout(timeout)
    try:
        while conn.recv(4096):
            pass
        return True
    except TimeoutError:
        return False
    except OSError:  # reset
        return True
