"""Control channel: the ZeroMQ Guide's Lazy Pirate client and a deduplicating server.

Promise: a halt or checkpoint request, retried until acknowledged, is applied at
most once; a retry of an applied request gets the stored ack; the trainer's side
costs one attribute check per batch boundary when nothing is pending. A request the
wire rules refuse (docs/protocol.md: its `t`, its op's args) is counted malformed and
answered with an error naming the field; one for an unknown op, or a checkpoint file
name that is not a plain name, is refused at once (ok false). Neither reaches the trainer.
Every request expires: `wait` seconds after it arrived (DEFAULT_WAIT without one), and it is
never applied in a fit later than the one it arrived in (`fit`, stamped on arrival). Refusals
are kept apart from the trainer's answers, so no number of them pushes an answer out.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from offloop.bus.errors import ControlTimeout, WireError
from offloop.bus.wire import (
    DEFAULT_LIMITS,
    Limits,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
    split_envelope,
)
from offloop.bus.wire.requests import CONTROL_ARGS, control_refusal

__all__ = ["ControlServer", "ControlClient", "ControlRequest", "Ack", "OPS", "DEFAULT_WAIT"]

log = logging.getLogger("offloop.control")

#: The only requests that ever flow back to a trainer.
OPS = ("halt", "checkpoint")

#: the lifetime of a request that carries no `wait`, in seconds: the longest any of offloop's
#: own clients waits by default (a callback's `control_timeout`; `ControlClient` and
#: `offloop halt` wait 30 s, and say so in `wait`)
DEFAULT_WAIT = 60.0


@dataclass
class ControlRequest:
    """A request handed to the trainer; answer it once with `ack()` or `refuse()`."""

    client: str
    req: int
    op: str
    args: dict[str, Any]
    received: float
    _server: ControlServer | None = field(default=None, repr=False)
    #: how long the client said it waits for the answer (from its first attempt), or None
    wait: float | None = None
    #: the fit it arrived in (or, between fits, after): the server's `fit` when it arrived
    fit: int = 1

    @property
    def key(self) -> tuple[str, int]:
        return (self.client, self.req)

    @property
    def lifetime(self) -> float:
        """Seconds it lives after it arrived: its `wait`, or DEFAULT_WAIT without one."""
        return DEFAULT_WAIT if self.wait is None else self.wait

    def given_up(self, now: float) -> bool:
        """Whether the client has stopped waiting: `lifetime` seconds after this server first
        received it (the client's clock is never compared with this one)."""
        return now - self.received > self.lifetime

    def ack(self, **result: Any) -> None:
        self._server._answer(self, ok=True, result=result, error=None)

    def refuse(self, error: str, **result: Any) -> None:
        self._server._answer(self, ok=False, result=result, error=error)


@dataclass(frozen=True)
class Ack:
    """The trainer's answer: `ok`, and for a checkpoint `result['path']` and `['step']`."""

    client: str
    req: int
    op: str
    ok: bool
    result: dict[str, Any]
    error: str | None


_HARD_CAP = 4  # libzmq drops a connection whose message exceeds this many times the limit
_RCVHWM = 4  # messages of one connection libzmq buffers for the server thread


@dataclass
class ControlStats:
    received: int = 0
    duplicates: int = 0
    malformed: int = 0
    refused: int = 0
    acked: int = 0
    unauthorized: int = 0
    oversized: int = 0
    #: refused because the trainer already had max_queued requests (or bytes) waiting
    overflow: int = 0
    #: a retry of a request answered so long ago that its ack is no longer kept: not applied again
    stale: int = 0
    #: answers (ok true) and refusals (ok false) forgotten to keep each store within keep_acks
    evicted_acks: int = 0
    evicted_refusals: int = 0


class ControlServer:
    """ROUTER socket served by a thread; requests queue for the trainer's `poll()`.
    `keep_acks`: how many of the trainer's answers that applied a request are kept for
    retries, how many refusals apart from them, and how many clients' highest `req` of each."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        limits: Limits = DEFAULT_LIMITS,
        keep_acks: int = 4096,
        max_queued: int = 256,
        max_queued_bytes: int = 16 << 20,
        authorize: Callable[[ControlRequest], str | None] | None = None,
        context: zmq.Context | None = None,
        curve=None,
    ) -> None:
        self.limits = limits
        self.stats = ControlStats()
        self.endpoint = ""
        self._authorize = authorize
        self._host, self._port = host, port
        self._keep_acks = keep_acks
        #: requests the server thread queued for the next poll(), oldest first (the trainer
        #: reads its truth value each batch instead of calling poll() for nothing)
        self.inbox: deque[ControlRequest] = deque()
        #: called on the server thread after each request joins the inbox: a trainer
        #: waiting at a boundary (not polling each batch) is woken by it
        self.on_request: Callable[[], None] | None = None
        #: the fit a request arriving now belongs to: the one running, or the last one until the
        #: next begins (the trainer's Control sets it at each fit's start); stamped on each
        self.fit = 1
        self._outbox: deque[tuple[ControlRequest, bytes, bool]] = deque()
        # key -> latest attempt's routing envelope
        self._pending: dict[tuple[str, int], list[bytes]] = {}
        # at most this many requests (and bytes of them) wait for the trainer; more are refused
        self._max_queued, self._max_queued_bytes = max_queued, max_queued_bytes
        self._pending_bytes: dict[tuple[str, int], int] = {}
        self._queued_bytes = 0
        # acks kept for retries: the trainer's answers (ok true), and apart from them every
        # refusal, the trainer's and the server's (so no number of refusals ever pushes out an
        # answer a retry of an applied request needs); keep_acks of each
        self._acks: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self._refusals: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        # each client's highest request the trainer has answered, applied ones apart from
        # refused ones (keep_acks clients each, least recently answered out): a retry at or
        # below it whose ack is no longer kept was answered already (a client sends in order)
        self._answered: OrderedDict[str, int] = OrderedDict()
        self._refused: OrderedDict[str, int] = OrderedDict()
        self._own_context = context is None
        self._ctx = context or zmq.Context()
        self._wake_lock = threading.Lock()
        self._inproc = f"inproc://offloop-control-{uuid.uuid4().hex[:12]}"
        self._thread: threading.Thread | None = None
        self._curve = curve  # bus.security.ServerKeys: only authorised client keys get through

    def start(self) -> str:
        router = self._ctx.socket(zmq.ROUTER)
        # A request over the limit is counted and refused by length, never decoded; one past
        # _HARD_CAP times the limit is cut off by libzmq before it is even buffered whole.
        router.maxmsgsize = _HARD_CAP * self.limits.max_body_bytes
        # libzmq stops reading a connection once this many of its messages wait for this
        # thread (TCP holds the rest): on a busy machine a flood of large requests from one
        # peer was buffered whole in the trainer; a client sends one request at a time
        router.rcvhwm = _RCVHWM
        router.linger = 0
        monitor = None
        if self._curve is not None:
            self._curve.apply(router)
            monitor = router.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                                | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
        router.bind(f"tcp://{self._host}:{self._port or '*'}")
        self.endpoint = router.last_endpoint.decode()
        wake = self._ctx.socket(zmq.PAIR)
        wake.bind(self._inproc)
        self._wake = self._ctx.socket(zmq.PAIR)
        self._wake.connect(self._inproc)
        self._thread = threading.Thread(target=self._serve, args=(router, wake, monitor),
                                        daemon=True, name="offloop-control")
        self._thread.start()
        return self.endpoint

    # ------------------------------------------------------- trainer side

    def poll(self) -> list[ControlRequest]:
        """Requests that arrived since the last call; never blocks."""
        if not self.inbox:
            return []
        out = []
        while self.inbox:
            out.append(self.inbox.popleft())
        return out

    def _answer(self, request: ControlRequest, ok: bool, result: dict, error: str | None) -> None:
        body = encode_reply("ack", client=request.client, req=request.req, op=request.op, ok=ok,
                            result=result, error=error)
        self._outbox.append((request, body, ok))
        with self._wake_lock:
            try:
                self._wake.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                pass  # the server thread already has wake-ups queued; it drains the whole outbox

    # ------------------------------------------------------- server thread

    def _serve(self, router: zmq.Socket, wake: zmq.Socket, monitor: zmq.Socket | None) -> None:
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        if monitor is not None:
            poller.register(monitor, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if wake in ready:
                    if not self._send_acks(router, wake):
                        return
                if router in ready:
                    while router.poll(0):
                        self._receive(router, router.recv_multipart(copy=False))
                if monitor is not None and monitor in ready:
                    self._handshake_failures(monitor)
        finally:
            if monitor is not None:
                router.disable_monitor()
                monitor.close(linger=0)
            router.close(linger=0)
            wake.close(linger=0)

    def _handshake_failures(self, monitor: zmq.Socket) -> None:
        """A client whose key is not authorised never gets a message through: count it."""
        from zmq.utils.monitor import recv_monitor_message

        while monitor.poll(0):
            event = recv_monitor_message(monitor)
            self.stats.unauthorized += 1
            log.warning("offloop control: refused a client at %s (%s): its key is not authorised",
                        event.get("endpoint", b"").decode(errors="replace"),
                        "bad key" if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH
                        else "handshake")

    def _send_acks(self, router: zmq.Socket, wake: zmq.Socket) -> bool:
        alive = True
        while wake.poll(0):
            alive = wake.recv() != b"stop" and alive
        while self._outbox:
            request, body, ok = self._outbox.popleft()
            envelope = self._pending.pop(request.key, None)
            self._queued_bytes -= self._pending_bytes.pop(request.key, 0)
            self._remember(self._acks if ok else self._refusals, request.key, body)
            client, req = request.key
            answered = self._answered if ok else self._refused
            answered[client] = max(req, answered.pop(client, req))
            while len(answered) > self._keep_acks:
                answered.popitem(last=False)
            self.stats.acked += 1
            if envelope is not None:
                router.send_multipart([*envelope, body])
        return alive

    def _remember(self, store: OrderedDict, key: tuple[str, int], body: bytes) -> None:
        store[key] = body
        while len(store) > self._keep_acks:
            store.popitem(last=False)
            if store is self._acks:
                self.stats.evicted_acks += 1
            else:
                self.stats.evicted_refusals += 1

    def _refuse_now(self, router: zmq.Socket, envelope: list[bytes], request: ControlRequest,
                    error: str) -> bytes:
        body = encode_reply("ack", client=request.client, req=request.req, op=request.op,
                            ok=False, result={}, error=error)
        router.send_multipart([*envelope, body])
        return body

    def _receive(self, router: zmq.Socket, frames: list) -> None:
        split = split_envelope(frames)  # from a client, or relayed by `offloop relay`
        if split is None:
            self.stats.malformed += 1
            return
        envelope, frame = split
        if len(frame) > self.limits.max_body_bytes:
            self.stats.oversized += 1
            router.send_multipart([*envelope, encode_reply(
                "error", error=f"request is {len(frame)} bytes, the limit is "
                               f"{self.limits.max_body_bytes}")])
            return
        try:
            body = decode_request(frame, self.limits)
            if body["k"] != "ctl":
                raise WireError(f"request kind {body['k']!r} is not served on the control socket")
        except WireError as exc:
            self.stats.malformed += 1
            router.send_multipart([*envelope, encode_reply("error", error=str(exc))])
            return
        self.stats.received += 1
        request = ControlRequest(body["client"], body["req"], body["op"], body["args"],
                                 time.time(), self, body.get("wait"), self.fit)
        key = request.key
        kept = self._acks.get(key) or self._refusals.get(key)
        if kept is not None:
            self.stats.duplicates += 1
            router.send_multipart([*envelope, kept])
            return
        if key in self._pending:
            self.stats.duplicates += 1
            self._pending[key] = envelope  # the ack goes to the latest attempt
            return
        if request.req <= max(self._answered.get(request.client, -math.inf),
                              self._refused.get(request.client, -math.inf)):
            self.stats.stale += 1
            self._refuse_now(router, envelope, request, (
                f"request {request.req} of client {request.client} was answered long ago "
                "(its ack is no longer kept): not applied again"))
            return
        refusal = self._refusal(request, frame)
        if refusal:
            self.stats.refused += 1
            self._remember(self._refusals, key,
                           self._refuse_now(router, envelope, request, refusal))
            return
        size = len(frame)
        if (len(self._pending) >= self._max_queued
                or self._queued_bytes + size > self._max_queued_bytes):
            self.stats.overflow += 1  # not kept: a retry once the queue has room is served
            self._refuse_now(router, envelope, request, (
                f"the trainer has {len(self._pending)} requests ({self._queued_bytes} bytes) "
                f"waiting, the most it queues ({self._max_queued}, {self._max_queued_bytes} "
                "bytes): refused, ask again later"))
            return
        self._pending_bytes[key] = size
        self._queued_bytes += size
        self._pending[key] = envelope
        self.inbox.append(request)
        if self.on_request is not None:
            self.on_request()

    def _refusal(self, request: ControlRequest, frame: zmq.Frame) -> str | None:
        if request.op not in OPS:
            return f"unknown control op {request.op!r}; valid ops are {', '.join(OPS)}"
        refusal = control_refusal(request.op, request.args)  # a file name outside the folder
        if refusal:
            return refusal
        # with keys: the role of the key this connection authenticated with, as authorised now
        reason = (self._curve.access.refusal(frame.get("User-Id"), request.op)
                  if self._curve is not None else None)
        if reason is None and self._authorize is not None:
            reason = self._authorize(request)
        if reason:
            self.stats.unauthorized += 1
        return reason

    def close(self) -> None:
        if self._thread is not None:
            with self._wake_lock:
                self._wake.send(b"stop")
            self._thread.join(timeout=5)
            self._wake.close(linger=0)
            self._thread = None
        if self._own_context:
            self._ctx.term()


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
                retry: float = 0.5, req: int | None = None) -> Ack:
        """Send until acknowledged; raises ControlTimeout after `timeout` seconds."""
        req = next(self._ids) if req is None else req
        # the args each op must carry (a halt's reason, a checkpoint's tag) default to "", so
        # that what this client sends is always a valid request
        args = {**{name: "" for name, (_, required) in CONTROL_ARGS.get(op, {}).items()
                   if required},
                **(args or {})}
        body = encode_request("ctl", client=self.client_id, req=req, op=op, args=args,
                              t=time.time(), wait=float(timeout))
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                sock = self._socket()
                sock.send(body)
                self.attempts += 1
                until = min(deadline, time.monotonic() + retry)
                while (left := until - time.monotonic()) > 0:
                    if not sock.poll(math.ceil(left * 1000)):  # whole ms: poll(0.4) would not wait
                        break
                    reply = decode_reply(sock.recv(), self.limits)
                    if reply["k"] == "error":
                        raise WireError(f"control server refused the message: {reply['error']}")
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
