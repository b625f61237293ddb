"""The events proxy: a thread that forwards events from the inproc XSUB to the public
XPUB and subscriptions the other way; stopped and started again around a cut. The
trainer's publisher and `offloop relay` both run it, in one of two ways:

- libzmq's proxy, in C without the GIL (a run without keys: every local account may
  already halt it); the subscriptions in force are bounded by their number, from the
  service thread (subscription_cap.FloodCut);
- with subscriptions capped (a run with keys, where a monitor key is trusted with less):
  the public socket is in ZMQ_XPUB_MANUAL mode, so libzmq files a subscription only when
  this thread says so, after `SubscriptionCap` has counted it against the connection that
  sent it (its descriptor comes with the message). libzmq's proxy cannot tell which peer
  sent what, so this loop is Python's, and costs the process several times the CPU a
  burst that libzmq's does, with the GIL (docs/benchmarks.md, docs/reliability.md).

A cut unbinds the public socket (closing every connection made through its endpoint)
and binds the same port again: libzmq checks a CURVE key only at the handshake and
cannot drop one peer of a PUB socket, so this is how a revoked key loses its events.
"""

from __future__ import annotations

import logging
import threading
import time

import zmq

from offloop.bus.connection_cap import ConnectionCap
from offloop.bus.subscription_cap import SubscriptionCap, Verdict

__all__ = ["CAPPED_OPTIONS", "PUBLIC_OPTIONS", "RevocationCut", "run_events_proxy"]

log = logging.getLogger("offloop.bus")

_SUBSCRIBE, _UNSUBSCRIBE = 1, 0
#: the public socket's ZMQ_RCVHWM: messages of a connection libzmq reads ahead of the
#: thread that judges them (this one where capped, else the service thread's count). libzmq
#: records every subscription it reads (in manual mode too, to undo them when the peer
#: leaves), so a peer past its cap must be cut before libzmq has read much more
#: (docs/reliability.md). Not 1: with keys the pipe also holds the peer's credential,
#: which libzmq skips without counting it read, so at 1 a connection with keys stalls
SUBSCRIPTIONS_AHEAD = 2
#: the public socket's SO_RCVBUF in bytes (Linux doubles it): what a connection that was
#: cut still has in the kernel, which libzmq reads (and records) before it sees the end;
#: autotuned, that buffer grew to megabytes. Subscriptions are all that comes this way
RECEIVE_BUFFER = 4096
#: a public XPUB's options, set before it binds; CAPPED_OPTIONS where run_events_proxy
#: caps subscriptions
PUBLIC_OPTIONS = {"rcvhwm": SUBSCRIPTIONS_AHEAD, "rcvbuf": RECEIVE_BUFFER}
CAPPED_OPTIONS = {"xpub_manual": 1, **PUBLIC_OPTIONS}


def run_events_proxy(front: zmq.Socket, back: zmq.Socket, control: zmq.Socket,
                     cut: threading.Event, endpoint: str, connections: ConnectionCap | None = None,
                     subscriptions: SubscriptionCap | None = None) -> None:
    """Forward `front` to `back` until `control` says TERMINATE; when `cut` is set, unbind
    `back` from `endpoint`, bind it again and go on. Without `subscriptions`, libzmq's
    proxy; with them, the loop here files each subscription within their caps: `back` was
    made with CAPPED_OPTIONS, and `connections` is its cap, whose monitor this thread reads
    (telling `subscriptions` of each connection's start and end) and closes."""
    if subscriptions is None:
        def forward() -> None:
            zmq.proxy_steerable(front, back, None, control)
    else:
        def forward() -> None:
            _forward_capped(front, back, control, connections, subscriptions)
    try:
        while True:
            forward()  # until a TERMINATE: the end, or a cut
            if not cut.is_set():
                return
            cut.clear()
            back.unbind(endpoint)
            _bind_again(back, endpoint)
    except zmq.ContextTerminated:
        pass
    finally:
        for sock in (front, back, control):
            sock.close(linger=0)
        if subscriptions is not None:
            connections.close()


def _forward_capped(front: zmq.Socket, back: zmq.Socket, control: zmq.Socket,
                    connections: ConnectionCap, subscriptions: SubscriptionCap) -> None:
    """libzmq's proxy in Python, with subscriptions filed by connection; returns once
    `control` has said TERMINATE."""
    poller = zmq.Poller()
    for sock in (connections.monitor, back, front, control):
        poller.register(sock, zmq.POLLIN)
    while True:
        ready = dict(poller.poll())
        if connections.monitor in ready:  # first: a descriptor's end before its reuse
            _connections(connections, subscriptions, front)
        if back in ready:
            _subscriptions(back, front, subscriptions, connections)
        if front in ready:
            _events(front, back)
        if control in ready:
            control.recv()
            return


def _events(front: zmq.Socket, back: zmq.Socket) -> None:
    """Every events message waiting, forwarded without a copy (a tracked one completes
    once every subscriber's connection has it, as through libzmq's proxy). Frame by
    frame: recv_multipart's list and loop cost more than the forwarding itself."""
    recv, send = front.recv, back.send
    while True:
        try:
            frame = recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return
        while frame.more:  # a message of several frames (tensors) leaves whole, in order
            send(frame, zmq.SNDMORE, copy=False)
            frame = recv(copy=False)
        send(frame, copy=False)


def _connections(connections: ConnectionCap, ledger: SubscriptionCap, front: zmq.Socket) -> None:
    """Connections come and go: a connection that ended takes what it filed with it,
    passed upstream here (libzmq's own undoings name everything the peer sent, filed or
    not, and would take away a prefix another connection holds). A descriptor accepted
    again ends whatever the ledger still held on it."""
    opened, closed = connections.take()
    for fd in closed + opened:
        for prefix in ledger.closed(fd):
            front.send(b"\x00" + prefix)
    for fd in opened:
        ledger.opened(fd)


def _subscriptions(back: zmq.Socket, front: zmq.Socket, ledger: SubscriptionCap,
                   connections: ConnectionCap) -> None:
    """Every message the public socket's peers sent: a subscription is filed and passed
    upstream if the ledger allows it; an unsubscription only of what that connection has
    filed; anything else goes upstream, where the publisher counts it (`events_foreign`).

    Descriptors are reused as soon as a connection ends, so each subscription is judged
    after the monitor's news up to it (libzmq says ACCEPTED before it reads a byte of the
    connection): the connection it names is the one that sent it, or one that has ended."""
    while True:
        try:
            message = back.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return
        data = message.bytes
        if not data or data[0] not in (_SUBSCRIBE, _UNSUBSCRIBE):
            front.send(message)
            continue
        try:
            fd = message.get(zmq.SRCFD)
        except zmq.ZMQError:  # libzmq's own, for a closed connection: _connections did it
            continue
        _connections(connections, ledger, front)
        if fd not in connections.live:  # it ended (or was cut at the cap): libzmq drops its pipe
            continue
        prefix = data[1:]
        if data[0] == _UNSUBSCRIBE:
            if ledger.unsubscribe(fd, prefix):
                back.setsockopt(zmq.UNSUBSCRIBE, prefix)  # for the connection it came by
                front.send(message)
            continue
        verdict = ledger.subscribe(fd, prefix)
        if verdict is Verdict.FILE:
            back.setsockopt(zmq.SUBSCRIBE, prefix)
            front.send(message)
        elif verdict is Verdict.KNOWN:
            # filed again for the pipe it came by: nothing new for the same connection (libzmq
            # files a pipe once a prefix), and a guard for a new one on a reused descriptor
            back.setsockopt(zmq.SUBSCRIBE, prefix)
        elif verdict is Verdict.CUT:
            if ledger.cut & (ledger.cut - 1) == 0:  # the 1st, 2nd, 4th, ...: a flood logs little
                log.warning("offloop: cut an events connection that asked for more than %d "
                            "subscriptions or for one longer than any topic's (%d connections cut "
                            "so far)", ledger.per_peer, ledger.cut)
            connections.cut_off(fd)


def _bind_again(sock: zmq.Socket, endpoint: str, attempts: int = 50) -> None:
    # the port was ours a moment ago; another process could take it meanwhile
    for _ in range(attempts):
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as exc:
            error = exc
            time.sleep(0.02)
    log.error("offloop: the events socket could not bind %s again after cutting a revoked key's "
              "connection (%s): no subscriber can reach this run's events from now on",
              endpoint, error)


class RevocationCut:
    """Cuts every events connection once a key has lost its role: `check()` (from the
    thread that owns `control`) reads the authorised keys again and, after a revocation,
    sets `cut` and stops the proxy, which rebinds its public socket. Every subscriber
    reconnects (what it missed meanwhile counts as lost, as any gap); the revoked key's
    handshake now fails."""

    def __init__(self, access, cut: threading.Event, control: zmq.Socket) -> None:
        self._access, self._cut, self._control = access, cut, control
        self._seen = access.revocations

    def check(self) -> bool:
        """Whether this check cut the connections."""
        self._access.refresh()
        if self._access.revocations <= self._seen:
            return False
        self._seen = self._access.revocations
        self._cut.set()
        self._control.send(b"TERMINATE")  # the proxy rebinds, and runs on
        return True
