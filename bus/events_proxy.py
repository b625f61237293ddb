"""The events proxy: libzmq's XSUB/XPUB proxy, run in C without the GIL, stopped and
started again around a cut. The trainer's publisher and `offloop relay` both run it.

A cut unbinds the public socket (closing every connection made through its endpoint)
and binds the same port again: libzmq checks a CURVE key only at the handshake and
cannot drop one peer of a PUB socket, so this is how a revoked key loses its events.
"""

from __future__ import annotations

import logging
import threading
import time

import zmq

__all__ = ["RevocationCut", "run_events_proxy"]

log = logging.getLogger("offloop.bus")


def run_events_proxy(front: zmq.Socket, back: zmq.Socket, control: zmq.Socket, cut: threading.Event,
                     endpoint: str) -> None:
    """Proxy `front` to `back` until `control` says TERMINATE; when `cut` is set, unbind
    `back` from `endpoint`, bind it again and go on."""
    try:
        while True:
            zmq.proxy_steerable(front, back, None, control)
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
        self._control.send(b"TERMINATE")  # the proxy returns, rebinds, and runs again
        return True
