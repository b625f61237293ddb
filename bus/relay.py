"""Relay: one process that fans a run out to many monitors, on ZeroMQ's own devices.

Pattern: the Guide's proxies. Events go through an XSUB/XPUB proxy (the trainer has one
subscriber, the relay, however many monitors join; subscriptions flow upstream, so the
trainer still serializes only what someone wants). The relay's proxy always files
subscriptions by connection (events_proxy's capped loop, keys or not): fanning out is
this process's whole job, so a monitor that floods it with subscriptions is cut here
rather than growing the relay without bound and being cut, with the relay's connection
and every monitor behind it, at the trainer. Late-join state,
run info and control requests go through ROUTER/DEALER, one hop, with the client's
routing identity in the envelope (`wire.split_envelope`).

Promise: messages pass through unchanged, so sequence numbers, heartbeats and gap
accounting are the trainer's own: a monitor counts exactly what it lost, whether the
relay's queue for it dropped it or the trainer's did. With keys, the relay is a CURVE
server to its monitors (its own `authorized/` folder, read again when it changes, roles
enforced here: a monitor key cannot halt) and a CURVE client of the trainer, whose key
the trainer must authorise as `control` for halts and checkpoints to pass. A relay never
offers less than the run behind it: for a run with keys it refuses to start without keys
of its own (`keys`), whatever its host. Run info is
answered with the relay's endpoints and key, so `attach`, `worker`, `halt` and
`checkpoint` given the relay's state endpoint stay on the relay.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import zmq

from offloop.bus.connection_cap import MAX_CONNECTIONS, ConnectionCap
from offloop.bus.discovery import RunInfo
from offloop.bus.errors import WireError
from offloop.bus.events_proxy import CAPPED_OPTIONS, RevocationCut, run_events_proxy
from offloop.bus.security import SecurityError
from offloop.bus.subscription_cap import PER_PEER, SubscriptionCap
from offloop.bus.wire import (
    DEFAULT_LIMITS,
    HEARTBEAT_TOPIC,
    MAX_SUBSCRIPTION_BYTES,
    Limits,
    decode_event,
    decode_reply,
    decode_request,
    encode_reply,
    request_socket_cap,
    topic_prefix,
)

__all__ = ["Relay", "RelayStats"]

log = logging.getLogger("offloop.relay")

#: requests from one connection libzmq queues for the relay's thread (TCP holds the rest)
_REQUEST_RCVHWM = 16
#: monitors connected to the relay's events socket at once: fanning out is its job, and
#: each costs it a few KiB (its frame limit is 1 KiB)
RELAY_EVENTS_CONNECTIONS = 1024


@dataclass
class RelayStats:
    state_requests: int = 0  # late-join state and run info requests forwarded
    control_forwarded: int = 0
    control_refused: int = 0  # refused here: a monitor key asking to halt or checkpoint
    replies: int = 0  # answers from the trainer routed back
    malformed: int = 0  # requests of another layout, or that do not decode
    unauthorized: int = 0  # requests from a key revoked since it connected
    beats: int = 0  # the trainer's heartbeats seen
    silences: int = 0  # times the trainer fell silent for longer than the heartbeat timeout
    cuts: int = 0  # events connections cut after a key was revoked
    connections_cut: int = 0  # connections shut down at once: a socket had its most already
    subscriptions_refused: int = 0  # past a monitor's or the relay's cap (subscription_cap)


class Relay:
    """Forwards one run (its rank 0: events, state, control) to many monitors.

    `keys` (bus.security.ServerKeys) makes the relay's sockets CURVE servers; `upstream`
    (bus.security.ClientKeys) is the key it talks to the trainer with."""

    def __init__(self, info: RunInfo, *, host: str = "127.0.0.1", events_port: int = 0,
                 state_port: int = 0, control_port: int = 0, keys=None, upstream=None,
                 subscriber_hwm: int = 10_000, heartbeat_timeout: float = 10.0,
                 limits: Limits = DEFAULT_LIMITS, context: zmq.Context | None = None) -> None:
        if info.curve_public and upstream is None:
            raise SecurityError(f"run {info.run_name} has keys: the relay needs a client key "
                                "the trainer authorises (--keys DIR --key-name NAME)")
        if (info.curve_public or upstream is not None) and keys is None:
            # never less than the run behind it: without keys of its own, any local account
            # could read the run and halt it through the relay's control key
            raise SecurityError(
                f"run {info.run_name} has keys: the relay needs keys of its own too, or any "
                "local account could read and halt the run through it; pass --keys DIR (its "
                "trainer.key_secret is the relay's server key, its authorized/ the monitors "
                "it admits, with their roles)")
        self.info = info
        self.upstream = dict(info.endpoints)
        self.host = host
        self._ports = {"events": events_port, "state": state_port, "control": control_port}
        self.keys, self._upstream_keys = keys, upstream
        self.subscriber_hwm = subscriber_hwm
        self.heartbeat_timeout = heartbeat_timeout
        self.limits = limits
        self.stats = RelayStats()
        self.endpoints: dict[str, str] = {}
        #: set once the trainer's final heartbeat has passed through
        self.finished = threading.Event()
        self.last_beat = time.monotonic()
        self._own_context = context is None
        self._ctx = context or zmq.Context()
        self._auth = None
        self._inproc = f"inproc://offloop-relay-{uuid.uuid4().hex[:12]}"
        self._cut = threading.Event()
        self._threads: list[threading.Thread] = []
        self._revocation: RevocationCut | None = None
        self._caps: dict[str, ConnectionCap] = {}
        # the events thread's alone; no more distinct prefixes than the trainer lets one
        # connection have, so that the relay's own connection is never cut for its
        # monitors' sake, and half of them a monitor, so that one alone cannot take them all
        self._subscriptions = SubscriptionCap(per_peer=PER_PEER // 2, total=PER_PEER)

    # ------------------------------------------------------------ set-up

    def start(self) -> dict[str, str]:
        """Connect to the trainer, bind the public sockets, start forwarding; the endpoints."""
        ctx = self._ctx
        if self.keys is not None:
            self._auth = self.keys.start_authenticator(ctx)
        # options before bind/connect: libzmq reads them when it makes each connection's pipe
        front = self._upstream_socket(zmq.XSUB, "events", rcvhwm=self.subscriber_hwm,
                                      maxmsgsize=self.limits.max_message_bytes)
        back = self._public_socket(zmq.XPUB, "events", RELAY_EVENTS_CONNECTIONS,
                                   sndhwm=self.subscriber_hwm, maxmsgsize=MAX_SUBSCRIPTION_BYTES,
                                   **CAPPED_OPTIONS)
        proxy_ctl = ctx.socket(zmq.PAIR)
        proxy_ctl.bind(self._inproc + "-proxy")
        self._proxy_ctl = ctx.socket(zmq.PAIR)
        self._proxy_ctl.connect(self._inproc + "-proxy")
        if self.keys is not None:
            self._revocation = RevocationCut(self.keys.access, self._cut, self._proxy_ctl)

        names = ["state", "control"] if "control" in self.upstream else ["state"]
        sockets = {name: (self._public_socket(zmq.ROUTER, name, MAX_CONNECTIONS,
                                              maxmsgsize=request_socket_cap(self.limits),
                                              rcvhwm=_REQUEST_RCVHWM),
                          self._upstream_socket(zmq.DEALER, name,
                                                maxmsgsize=self.limits.max_message_bytes))
                   for name in names}
        beats = self._upstream_socket(zmq.SUB, "events")
        beats.subscribe(topic_prefix(HEARTBEAT_TOPIC))
        stop = ctx.socket(zmq.PAIR)
        stop.bind(self._inproc + "-stop")
        self._stop = ctx.socket(zmq.PAIR)
        self._stop.connect(self._inproc + "-stop")

        self._threads = [
            threading.Thread(target=run_events_proxy,
                             args=(front, back, proxy_ctl, self._cut, self.endpoints["events"],
                                   self._caps["events"], self._subscriptions),
                             daemon=True, name="offloop-relay-events"),
            threading.Thread(target=self._serve, args=(sockets, beats, stop), daemon=True,
                             name="offloop-relay-requests"),
        ]
        for thread in self._threads:
            thread.start()
        return dict(self.endpoints)

    def _public_socket(self, kind: int, name: str, max_connections: int,
                       **options: int) -> zmq.Socket:
        """A socket monitors connect to (a CURVE server with keys) and at most
        `max_connections` at once, bound; its endpoint kept."""
        sock = self._socket(kind, self.keys, **options)
        self._caps[name] = ConnectionCap(sock, max_connections)  # before bind: sees them all
        sock.bind(f"tcp://{self.host}:{self._ports[name] or '*'}")
        self.endpoints[name] = sock.last_endpoint.decode()
        return sock

    def _upstream_socket(self, kind: int, name: str, **options: int) -> zmq.Socket:
        """A socket connected to the trainer's `name` endpoint (with the relay's client key)."""
        sock = self._socket(kind, self._upstream_keys, **options)
        sock.connect(self.upstream[name])
        return sock

    def _socket(self, kind: int, keys, **options: int) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.linger = 0
        for option, value in options.items():  # before bind/connect: read when a pipe is made
            setattr(sock, option, value)
        if keys is not None:
            keys.apply(sock)
        return sock

    # ------------------------------------------------------------ serving

    def _serve(self, sockets: dict[str, tuple[zmq.Socket, zmq.Socket]], beats: zmq.Socket,
               stop: zmq.Socket) -> None:
        poller = zmq.Poller()
        routes = {}
        for name, (public, dealer) in sockets.items():
            poller.register(public, zmq.POLLIN)
            poller.register(dealer, zmq.POLLIN)
            routes[public] = (name, dealer)
            routes[dealer] = (name, public)
        poller.register(beats, zmq.POLLIN)
        poller.register(stop, zmq.POLLIN)
        # the events socket's monitor is the events thread's (it files subscriptions by
        # connection)
        requests = [cap for name, cap in self._caps.items() if name != "events"]
        monitors = {cap.monitor: cap for cap in requests}
        for monitor in monitors:
            poller.register(monitor, zmq.POLLIN)
        silent, next_check = False, time.monotonic()
        try:
            while True:
                ready = dict(poller.poll(500))
                if stop in ready:
                    return
                if beats in ready:
                    silent = self._heard(beats, silent)
                if any(monitor in ready for monitor in monitors):
                    for cap in requests:
                        cap.take()
                self.stats.connections_cut = sum(cap.cut for cap in self._caps.values())
                self.stats.subscriptions_refused = self._subscriptions.refused
                for sock in ready:
                    if sock in routes:
                        name, other = routes[sock]
                        while sock.poll(0):
                            frames = sock.recv_multipart(copy=False)
                            if sock.socket_type == zmq.ROUTER:
                                self._forward(name, frames, sock, other)
                            else:
                                self._route_back(name, frames, other)
                now = time.monotonic()
                if not silent and now - self.last_beat > self.heartbeat_timeout:
                    silent = True
                    self.stats.silences += 1
                    log.warning("offloop relay: no heartbeat from %s for %gs: the trainer is "
                                "gone or cut off; monitors see the same silence",
                                self.upstream["events"], self.heartbeat_timeout)
                if now >= next_check:
                    next_check = now + 1.0
                    self._cut_revoked()
        finally:
            for public, dealer in sockets.values():
                public.close(linger=0)
                dealer.close(linger=0)
            beats.close(linger=0)
            stop.close(linger=0)
            for cap in requests:
                cap.close()

    def _heard(self, beats: zmq.Socket, silent: bool) -> bool:
        """Take the trainer's heartbeats: liveness, and the final one."""
        while beats.poll(0):
            try:
                beat = decode_event(beats.recv_multipart(copy=False), self.limits)
            except WireError:
                continue
            self.stats.beats += 1
            self.last_beat = time.monotonic()
            if silent:
                silent = False
                log.warning("offloop relay: %s heard again", self.upstream["events"])
            if beat.data.get("final"):
                self.finished.set()
        return silent

    def _forward(self, name: str, frames: list, public: zmq.Socket, dealer: zmq.Socket) -> None:
        """A monitor's request: checked here (layout, key, role), then sent on to the trainer
        as [client, b"", body], the envelope the trainer answers to."""
        if len(frames) != 2:
            self.stats.malformed += 1
            return
        client, body = frames[0].bytes, frames[1]
        op = None
        if name == "control":
            try:
                request = decode_request(body, self.limits)
            except WireError as exc:
                self.stats.malformed += 1
                public.send_multipart([client, encode_reply("error", error=str(exc))])
                return
            op = request.get("op")
        refusal = (self.keys.access.refusal(body.get("User-Id"), op)
                   if self.keys is not None else None)
        if refusal:
            if op is None:
                self.stats.unauthorized += 1
                public.send_multipart([client, encode_reply("error", error=refusal)])
            else:
                self.stats.control_refused += 1
                public.send_multipart([client, encode_reply(
                    "ack", client=request["client"], req=request["req"], op=op, ok=False, result={},
                    error=f"refused by the relay: {refusal}")])
            return
        if name == "control":
            self.stats.control_forwarded += 1
        else:
            self.stats.state_requests += 1
        dealer.send_multipart([client, b"", body], copy=False)

    def _route_back(self, name: str, frames: list, public: zmq.Socket) -> None:
        """The trainer's answer, [client, b"", reply...], to the monitor that asked; run info
        names the relay's endpoints instead of the trainer's."""
        if len(frames) < 3 or len(frames[1]) != 0:
            self.stats.malformed += 1
            return
        client, reply = frames[0].bytes, frames[2:]
        self.stats.replies += 1
        if name == "state" and len(reply) == 1:
            reply = [self._relayed_info(reply[0])]
        public.send_multipart([client, *reply], copy=False)

    def _relayed_info(self, frame) -> Any:
        try:
            reply = decode_reply(frame, self.limits)
        except WireError:
            return frame
        if reply.get("k") != "info" or not isinstance(reply.get("run"), dict):
            return frame
        return encode_reply("info", run=self.relayed(reply["run"]))

    def relayed(self, run: dict[str, Any]) -> dict[str, Any]:
        """Run info (run.json's fields) as a monitor of this relay must see it: the relay's
        endpoints and key, and the trainer's state endpoint in `extra.relayed_from`."""
        return {**run, "endpoints": dict(self.endpoints),
                "ranks": [{k: v for k, v in self.endpoints.items() if k != "control"}],
                "curve_public": self.keys.public.decode() if self.keys is not None else "",
                "extra": {**(run.get("extra") or {}),
                          "relayed_from": self.upstream.get("state", "")}}

    def _cut_revoked(self) -> None:
        """A monitor key revoked at the relay keeps no events connection (RevocationCut)."""
        if self._revocation is not None and self._revocation.check():
            self.stats.cuts += 1

    # ------------------------------------------------------------ life

    def serve(self, give_up_after: float | None = None, linger: float = 1.0) -> str:
        """Block until the run finishes (then `linger` seconds, so the final heartbeats reach
        every monitor), or the trainer has been silent for `give_up_after` seconds; why."""
        while True:
            if self.finished.wait(0.2):
                time.sleep(linger)
                return "finished"
            if give_up_after is not None and time.monotonic() - self.last_beat > give_up_after:
                return "silent"

    def close(self) -> None:
        if not self._threads:
            return
        self._stop.send(b"stop")
        self._threads[1].join(timeout=5)
        self._proxy_ctl.send(b"TERMINATE")
        self._threads[0].join(timeout=5)
        self._stop.close(linger=0)
        self._proxy_ctl.close(linger=0)
        self._threads = []
        if self._auth is not None:
            self._auth.stop()
        if self._own_context:
            self._ctx.term()

    def __enter__(self) -> Relay:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
