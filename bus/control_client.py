"""The control channel's client: the ZeroMQ Guide's Lazy Pirate (bus/control.py has the
server and the promise both keep)."""

from __future__ import annotations

import itertools
import math
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import zmq

from offloop.bus.control import Ack
from offloop.bus.errors import ControlTimeout, WireError
from offloop.bus.wire import (
    DEFAULT_LIMITS,
    Limits,
    check_request_size,
    decode_reply,
    encode_request,
)
from offloop.bus.wire.requests import CONTROL_ARGS

__all__ = ["ControlClient"]


class ControlClient:
    """The Guide's Lazy Pirate: send, wait, and on silence reopen the socket and send again.
    Between requests the socket stays connected, so a request on a live connection is one
    send (no TCP and ZMTP handshake each time); `connect()` makes that connection ahead of
    the first request. One request at a time per client (a lock orders callers)."""

    _ids = itertools.count(1)

    def __init__(self, endpoint: str, *, client_id: str | None = None,
                 limits: Limits = DEFAULT_LIMITS, context: zmq.Context | None = None,
                 curve=None) -> None:
        self.endpoint = endpoint
        self.client_id = client_id or uuid.uuid4().hex[:12]
        self.limits = limits
        self.attempts = 0
        self._curve = curve  # bus.security.ClientKeys
        self._own_context = context is None
        self._ctx = context or zmq.Context()
        self._sock: zmq.Socket | None = None
        self._lock = threading.Lock()

    def connect(self) -> ControlClient:
        """Open the connection now, so the first request does not wait for it."""
        with self._lock:
            self._socket()
        return self

    def request(self, op: str, args: dict[str, Any] | None = None, *, timeout: float = 30.0,
                retry: float = 0.5, req: int | None = None,
                on_taken: Callable[[dict[str, Any]], None] | None = None) -> Ack:
        """Send until acknowledged; raises ControlTimeout after `timeout` seconds.
        `on_taken(result)` is called once if the trainer says the request is applied before
        its answer (a checkpoint's state copied, its file being written)."""
        req = next(self._ids) if req is None else req
        # the args each op must carry (a halt's reason, a checkpoint's tag) default to "", so
        # that what this client sends is always a valid request
        args = {**{name: "" for name, (_, required) in CONTROL_ARGS.get(op, {}).items()
                   if required},
                **(args or {})}
        body = encode_request("ctl", client=self.client_id, req=req, op=op, args=args,
                              t=time.time(), wait=float(timeout))
        check_request_size(len(body), self.limits)  # here, not as a dropped connection there
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                sock = self._socket()
                try:  # a refused handshake ends the socket's one connection: a blocking send
                    sock.send(body, zmq.NOBLOCK)  # would then wait for one that never comes
                except zmq.Again:
                    pass  # not sent: the next attempt's socket tries again
                self.attempts += 1
                until = min(deadline, time.monotonic() + retry)
                while (left := until - time.monotonic()) > 0:
                    if not sock.poll(math.ceil(left * 1000)):  # whole ms: poll(0.4) would not wait
                        break
                    reply = decode_reply(sock.recv(), self.limits)
                    if reply["k"] == "error":
                        raise WireError(f"control server refused the message: {reply['error']}")
                    if reply["k"] == "taken" and (reply["client"], reply["req"]) == (
                            self.client_id, req):
                        if on_taken is not None:
                            on_taken(reply["result"])
                            on_taken = None
                        continue
                    if (reply["k"] == "ack"
                            and (reply["client"], reply["req"]) == (self.client_id, req)):
                        return Ack(reply["client"], reply["req"], reply["op"], reply["ok"],
                                   reply["result"], reply.get("error"))
                self._drop()  # silence: the request may be stuck in this socket; a new one
                if time.monotonic() >= deadline:
                    raise ControlTimeout(
                        f"no acknowledgement for {op} from {self.endpoint} within {timeout:g}s "
                        f"({self.attempts} attempts)"
                    )

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.linger = 0
            sock.maxmsgsize = self.limits.max_body_bytes
            if self._curve is not None:
                self._curve.apply(sock)
            sock.connect(self.endpoint)
            self._sock = sock
        return self._sock

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def named(self, client_id: str) -> ControlClient:
        """A client of the same endpoint, keys and context under another id: each callback
        of a worker process asks under its own name (the trainer's `stopped_by` and acks
        name it). Closing it leaves the shared context to this client."""
        return ControlClient(self.endpoint, client_id=client_id, limits=self.limits,
                             context=self._ctx, curve=self._curve)

    def halt(self, reason: str = "", **kw: Any) -> Ack:
        return self.request("halt", {"reason": reason}, **kw)

    def checkpoint(self, tag: str = "", **kw: Any) -> Ack:
        return self.request("checkpoint", {"tag": tag}, **kw)

    def close(self) -> None:
        """Close the connection; the client's own context (with every socket in it: those of
        its named() clients too) ends here."""
        with self._lock:
            self._drop()
        if self._own_context:
            self._ctx.destroy(linger=0)

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
