"""A TCP forwarder that can stop forwarding: a partition between two sockets of one host.

`PausableLink(upstream)` listens on a loopback port and forwards each connection to
`upstream` in a thread; while paused it reads and writes nothing, so the bytes wait in
the kernel's buffers and the sender's queue fills, as across a cut network link. A small
receive buffer on the upstream side keeps what the kernel holds small.

Which events a cut loses is then exact only once two more buffers are pinned down:
`publisher_behind_link()` gives the publisher kernel send buffers that do not grow, and
its `HeartbeatProbe.past(seq)` waits until the publisher's proxy has let go of every event
up to `seq`, so none is still on its way when the link heals.
"""

from __future__ import annotations

import selectors
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import zmq
from helpers.waiting import wait_until

from offloop.bus import Publisher
from offloop.bus.wire import HEARTBEAT_TOPIC, decode_event, topic_prefix

__all__ = ["HeartbeatProbe", "PausableLink", "publisher_behind_link"]

_RCVBUF = 4096
_SNDBUF = 1 << 16


class HeartbeatProbe:
    """A SUB of heartbeats alone, straight on a publisher's events endpoint (not through
    the link). Heartbeats share the events' queue into the proxy, so once one that
    announces `seq` has left it, every event up to `seq` was sent or dropped."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self._sub = ctx.socket(zmq.SUB)
        self._sub.linger = 0
        self._sub.connect(endpoint)
        self._sub.subscribe(topic_prefix(HEARTBEAT_TOPIC))

    def past(self, seq: int, timeout: float = 30.0) -> None:
        """Wait for a heartbeat announcing `seq` or later; fail the test after `timeout`."""
        wait_until(lambda: self._sub.poll(50) and decode_event(self._sub.recv_multipart()).seq >= seq,
                   timeout, f"a heartbeat announcing seq {seq}")

    def close(self) -> None:
        self._sub.close()


@contextmanager
def publisher_behind_link(**publisher_args: Any) -> Iterator[tuple[Publisher, PausableLink, HeartbeatProbe]]:
    """A started Publisher, a PausableLink to its events endpoint, and a HeartbeatProbe.

    The publisher's context sets its sockets' kernel send buffers: Linux grows one left
    unset while the link is paused, up to tcp_wmem's max, at its own pace, so whether a
    flood's newest events got in before the heal would depend on the machine
    (docs/reliability.md, "a value lost at the tail")."""
    with zmq.Context() as ctx:
        ctx.setsockopt(zmq.SNDBUF, _SNDBUF)
        with Publisher(context=ctx, **publisher_args) as pub, PausableLink(pub.endpoints["events"]) as link:
            probe = HeartbeatProbe(ctx, pub.endpoints["events"])
            try:
                yield pub, link, probe
            finally:
                probe.close()


class PausableLink:
    """`with PausableLink("tcp://127.0.0.1:PORT") as link:` connect to `link.endpoint`."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.removeprefix("tcp://").rsplit(":", 1)
        self._upstream = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self._running = threading.Event()  # set: forwarding
        self._running.set()
        self._stop = False
        self._selector = selectors.DefaultSelector()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="pausable-link")

    def __enter__(self) -> PausableLink:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self._running.set()
        self._thread.join(timeout=5)
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()
        self._selector.close()

    def pause(self) -> None:
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def _serve(self) -> None:
        self._listener.setblocking(False)
        self._selector.register(self._listener, selectors.EVENT_READ)
        while not self._stop:
            if not self._running.wait(timeout=0.05):
                continue
            for key, _ in self._selector.select(timeout=0.05):
                if key.fileobj is self._listener:
                    self._accept()
                elif self._running.is_set():
                    self._forward(key.fileobj, key.data)

    def _accept(self) -> None:
        client, _ = self._listener.accept()
        upstream = socket.socket()
        upstream.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _RCVBUF)  # before connect: the window
        upstream.connect(self._upstream)
        for sock, other in ((client, upstream), (upstream, client)):
            sock.setblocking(True)
            self._selector.register(sock, selectors.EVENT_READ, other)

    def _forward(self, sock: socket.socket, other: socket.socket) -> None:
        try:
            data = sock.recv(65536)
            if data:
                other.sendall(data)
                return
        except OSError:
            pass
        for end in (sock, other):  # one side closed: close the pair
            try:
                self._selector.unregister(end)
            except (KeyError, ValueError):
                pass
            end.close()
