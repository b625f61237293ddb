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

from offloop.bus.connection_cap import MAX_CONNECTIONS, ConnectionCap
from offloop.bus.errors import WireError
from offloop.bus.request_budget import RequestBudget
from offloop.bus.wire import (
    DEFAULT_LIMITS,
    Limits,
    check_request_size,
    decode_request,
    encode_reply,
    request_socket_cap,
    split_envelope,
)
from offloop.bus.wire.requests import control_refusal

__all__ = ["ControlServer", "ControlRequest", "Ack", "OPS", "DEFAULT_WAIT"]

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

    def taken(self, **result: Any) -> None:
        """Not the answer: the request is applied and its answer follows (a checkpoint's
        state is copied, its file being written). Sent now, and to any retry until the ack."""
        self._server._taken(self, result)


@dataclass(frozen=True)
class Ack:
    """The trainer's answer: `ok`, and for a checkpoint `result['path']` and `['step']`."""

    client: str
    req: int
    op: str
    ok: bool
    result: dict[str, Any]
    error: str | None


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
    #: connections shut down at once: max_connections were already open
    connections_cut: int = 0


class ControlServer:
    """ROUTER socket served by a thread; requests queue for the trainer's `poll()`.
    `keep_acks`: how many of the trainer's answers that applied a request are kept for
    retries, how many refusals apart from them, and how many clients' highest `req` of each.
    `max_connections`: peers connected at once; a connection past them is shut down at once
    and counted (bus/connection_cap.py)."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        limits: Limits = DEFAULT_LIMITS,
        keep_acks: int = 4096,
        max_queued: int = 256,
        max_queued_bytes: int = 16 << 20,
        max_connections: int = MAX_CONNECTIONS,
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
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections!r}")
        self._max_connections = max_connections
        self._connections: ConnectionCap | None = None
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
        # the `taken` note of each pending request that has one (sent again to a retry)
        self._taken_notes: dict[tuple[str, int], bytes] = {}
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

    def refusals(self) -> dict[str, int]:
        """What this server refused from peers, by kind (`Publisher.count_refusals`)."""
        stats = self.stats
        return {"control_malformed": stats.malformed, "control_oversized": stats.oversized,
                "control_unauthorized": stats.unauthorized, "control_refused": stats.refused,
                "control_overflow": stats.overflow, "control_stale": stats.stale,
                "control_connections": stats.connections_cut}

    def start(self) -> str:
        router = self._ctx.socket(zmq.ROUTER)
        # A request over the limit is counted and refused by length, never decoded; a larger
        # one is cut off by libzmq before it is even buffered whole.
        router.maxmsgsize = request_socket_cap(self.limits)
        # libzmq stops reading a connection once this many of its messages wait for this
        # thread (TCP holds the rest): on a busy machine a flood of large requests from one
        # peer was buffered whole in the trainer; a client sends one request at a time
        router.rcvhwm = _RCVHWM
        router.linger = 0
        # at most max_connections peers at once; with keys, its monitor also counts the
        # clients whose key is refused
        handshakes = 0
        if self._curve is not None:
            self._curve.apply(router)
            handshakes = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        self._connections = ConnectionCap(router, self._max_connections, events=handshakes,
                                          on_event=self._handshake_failed)
        router.bind(f"tcp://{self._host}:{self._port or '*'}")
        self.endpoint = router.last_endpoint.decode()
        wake = self._ctx.socket(zmq.PAIR)
        wake.bind(self._inproc)
        self._wake = self._ctx.socket(zmq.PAIR)
        self._wake.connect(self._inproc)
        self._thread = threading.Thread(target=self._serve, args=(router, wake, self._connections),
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
        self._send_to_client(request, body, ok)

    def _taken(self, request: ControlRequest, result: dict) -> None:
        body = encode_reply("taken", client=request.client, req=request.req, op=request.op,
                            result=result)
        self._send_to_client(request, body, None)

    def _send_to_client(self, request: ControlRequest, body: bytes, ok: bool | None) -> None:
        """Queue a reply for the server thread (ok None: a `taken` note, not the answer)."""
        self._outbox.append((request, body, ok))
        with self._wake_lock:
            try:
                self._wake.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                pass  # the server thread already has wake-ups queued; it drains the whole outbox

    # ------------------------------------------------------- server thread

    def _serve(self, router: zmq.Socket, wake: zmq.Socket, connections: ConnectionCap) -> None:
        monitor = connections.monitor
        quiet = zmq.Poller()  # while the requests' budget rests: acks and connections only
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        for sock in (wake, monitor):
            quiet.register(sock, zmq.POLLIN)
            poller.register(sock, zmq.POLLIN)
        budget = RequestBudget()
        try:
            while True:
                ready = dict(budget.poll(poller, quiet))
                if wake in ready:
                    if not self._send_acks(router, wake):
                        return
                if router in ready:
                    with budget.round():
                        for _ in range(budget.round_size):
                            try:
                                frames = router.recv_multipart(zmq.NOBLOCK, copy=False)
                            except zmq.Again:
                                break
                            budget.read(frames)
                            self._receive(router, frames)
                if monitor in ready:
                    connections.take()
                    self.stats.connections_cut = connections.cut
        finally:
            router.disable_monitor()
            connections.close()
            router.close(linger=0)
            wake.close(linger=0)

    def _handshake_failed(self, event: dict) -> None:
        """A client whose key is not authorised never gets a message through: count it."""
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
            if ok is None:  # taken: the request stays pending; a retry gets this note again
                self._taken_notes[request.key] = body
                envelope = self._pending.get(request.key)
                if envelope is not None:
                    router.send_multipart([*envelope, body])
                continue
            self._taken_notes.pop(request.key, None)
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
        try:
            check_request_size(len(frame), self.limits)
        except WireError as exc:
            self.stats.oversized += 1
            router.send_multipart([*envelope, encode_reply("error", error=str(exc))])
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
            note = self._taken_notes.get(key)
            if note is not None:
                router.send_multipart([*envelope, note])
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
