"""At most so many connections at once on a socket that peers connect to.

libzmq accepts every connection a listening socket gets, and each may hold a partly sent
message up to the socket's frame limit while it waits for the rest (72 KiB a connection
on a request socket, docs/reliability.md), so memory grew with their number. libzmq has
no cap of its own; its socket monitor says when a connection is accepted (with its file
descriptor) and when one ends. Past the cap, a new connection is shut down at once
(`shutdown(2)` on libzmq's descriptor: libzmq sees the peer leave, closes it and frees
what it held) and counted; the peers already connected are untouched.

The thread that polls `monitor` calls `take()`; it need not own the socket.
"""

from __future__ import annotations

import os
import socket
import struct
import time
import uuid
from collections.abc import Callable

import zmq

__all__ = ["ConnectionCap", "MAX_CONNECTIONS", "bytes_received"]

#: connections at once on each of a run's sockets (a run's workers, monitors and clients
#: need a few dozen; a relay fans out to more)
MAX_CONNECTIONS = 128
#: seconds between looks at whether the connections counted are all still open, while
#: the cap is reached (a look costs a few system calls a connection)
_RECOUNT = 1.0
#: struct tcp_info (linux/tcp.h): where tcpi_bytes_received lies, a u64 (Linux 4.1 on)
_BYTES_RECEIVED = struct.Struct("=Q")
_BYTES_RECEIVED_AT = 128


class ConnectionCap:
    """Counts one socket's connections from its monitor and cuts those past `cap`.
    `events` asks the monitor for more kinds of event, handed to `on_event`."""

    def __init__(self, sock: zmq.Socket, cap: int = MAX_CONNECTIONS, *, events: int = 0,
                 on_event: Callable[[dict], None] | None = None) -> None:
        if cap < 1:
            raise ValueError(f"a connection cap must be at least 1, got {cap!r}")
        self.cap, self._on_event = cap, on_event
        # by hand, not get_monitor_socket(): an unbounded pipe, since an event dropped on a
        # full one would leave the count wrong
        endpoint = f"inproc://offloop-monitor-{uuid.uuid4().hex}"
        sock.monitor(endpoint, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
                     | events)
        self.monitor = sock.context.socket(zmq.PAIR)
        self.monitor.rcvhwm = 0
        self.monitor.connect(endpoint)
        self.live: set[int] = set()  # the descriptors of the connections in force
        self.cut = 0  # connections shut down because `cap` were already open
        self.port: int | None = None  # the listener's, from the first connection
        self._recounted = 0.0  # monotonic time of the last look

    def take(self, _monitor: zmq.Socket | None = None) -> tuple[list[int], list[int]]:
        """Take in the monitor's events (a poll handler); the descriptors of the
        connections kept and of those that ended meanwhile, in order."""
        opened, closed = [], []
        while self.monitor.poll(0):
            event = _monitor_event(self.monitor.recv_multipart())
            kind, fd = event["event"], event["value"]
            if kind == zmq.EVENT_ACCEPTED:
                port = self.port = _port(event["endpoint"])
                if len(self.live) >= self.cap:
                    closed += self._recount(port)
                if len(self.live) < self.cap:
                    self.live.add(fd)
                    opened.append(fd)
                else:
                    self.cut += 1
                    _shut_down(fd, port)
            elif kind == zmq.EVENT_DISCONNECTED:
                if fd in self.live:
                    self.live.discard(fd)
                    closed.append(fd)
            elif kind == zmq.EVENT_CLOSED:
                # the listener: an unbind (events_proxy's cut) ends every connection made
                # through it, and libzmq says DISCONNECTED for none of them
                closed += sorted(self.live)
                self.live.clear()
            elif self._on_event is not None:
                self._on_event(event)
        return opened, closed

    def cut_off(self, fd: int) -> None:
        """Shut down the connection on `fd`, if it is still one of this socket's (libzmq
        closes it and says so on the monitor)."""
        _shut_down(fd, self.port)

    def heaviest(self) -> int | None:
        """The descriptor of the connection in force whose peer has sent the most bytes
        (bytes_received; where the system gives no such figure, the highest descriptor),
        or None when there is none."""
        ranked = [((bytes_received(fd, self.port) or -1), fd) for fd in self.live]
        return max(ranked)[1] if ranked else None

    def _recount(self, port: int | None) -> list[int]:
        """Forget any connection that ended unseen (the monitor's pipe loses no event, so
        this is a guard): at most once every _RECOUNT seconds, not at every connection cut.
        The descriptors forgotten."""
        now = time.monotonic()
        if now - self._recounted < _RECOUNT:
            return []
        self._recounted = now
        gone = [fd for fd in self.live if not _accepted_on(fd, port)]
        self.live.difference_update(gone)
        return gone

    def close(self) -> None:
        self.monitor.close(linger=0)


def _monitor_event(frames: list[bytes]) -> dict:
    """A monitor message as pyzmq's `parse_monitor_message` reads it: the event, its value
    (a descriptor, an error number) and the endpoint. Read here because pyzmq's module for
    it imports asyncio, which a worker's start would pay for (docs/benchmarks.md)."""
    event, value = struct.unpack("=hi", frames[0])
    return {"event": zmq.Event(event), "value": value, "endpoint": frames[1]}


def _port(endpoint: bytes) -> int | None:
    """The TCP port of a listener's endpoint (b"tcp://127.0.0.1:5555"), or None."""
    try:
        return int(endpoint.rsplit(b":", 1)[-1])
    except ValueError:
        return None


def _connection(fd: int, port: int | None) -> socket.socket | None:
    """A socket object on a copy of `fd`, if `fd` is still a connection accepted on `port`
    (the listener's); closing it closes the copy only."""
    try:
        copy = os.dup(fd)
    except OSError:  # closed meanwhile
        return None
    try:
        conn = socket.socket(fileno=copy)
    except OSError:  # not a socket any more
        os.close(copy)
        return None
    try:
        if conn.getsockname()[1] == port:
            return conn
    except OSError:
        pass
    conn.close()
    return None


def bytes_received(fd: int, port: int | None) -> int | None:
    """What the peer of the connection on `fd` (accepted on `port`) has sent it so far, by
    the kernel's count (TCP_INFO), read or not; None where the system keeps no such count
    or `fd` is no longer such a connection."""
    conn = _connection(fd, port)
    if conn is None or not hasattr(socket, "TCP_INFO"):
        return None
    with conn:
        try:
            info = conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        except OSError:
            return None
    if len(info) < _BYTES_RECEIVED_AT + _BYTES_RECEIVED.size:  # a kernel before 4.1
        return None
    return _BYTES_RECEIVED.unpack_from(info, _BYTES_RECEIVED_AT)[0]


def _accepted_on(fd: int, port: int | None) -> bool:
    conn = _connection(fd, port)
    if conn is None:
        return False
    conn.close()
    return True


def _shut_down(fd: int, port: int | None) -> None:
    """Shut down the connection libzmq holds on `fd`: libzmq owns the descriptor, sees the
    peer leave, and closes it itself."""
    conn = _connection(fd, port)
    if conn is not None:
        with conn:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
