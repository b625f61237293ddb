"""The publisher's service thread: one loop, a handler per socket and two timers, as the
ZeroMQ Guide's clone server. Everything the publisher does off the training loop runs
here: heartbeats, the subscriptions a peer sends, late-join answers, held events the loop
left waiting, folding released events into the late-join state, and cutting the events
connections of a revoked key.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import zmq

from offloop.bus.connection_cap import ConnectionCap
from offloop.bus.events_proxy import CAPPED_OPTIONS, PUBLIC_OPTIONS, RevocationCut, run_events_proxy
from offloop.bus.held import HeldEvents
from offloop.bus.interest import Interest
from offloop.bus.late_join import LateJoin
from offloop.bus.outbox import Outbox
from offloop.bus.publisher_stats import PublisherStats
from offloop.bus.request_budget import RequestBudget
from offloop.bus.subscription_cap import FloodCut, SubscriptionCap
from offloop.bus.wire import MAX_SUBSCRIPTION_BYTES, EventEncoder, Limits, request_socket_cap

__all__ = ["PublisherService", "STALL_CHECK"]

#: seconds between the final heartbeats
FINAL_BEAT_GAP = 0.1
_LIVE_CHECK = 0.005  # seconds between looks, meanwhile, at whether a subscriber is still connected
#: seconds: held events older than this (and the hold interval) leave from the service thread
STALL_CHECK = 0.05
#: requests of one connection libzmq reads ahead for the state socket: a client asks one at
#: a time, and a flood of large ones waits in TCP (the sender's memory), not in ours
STATE_RCVHWM = 4


class PublisherService:
    """The publisher's proxy and service threads, their sockets, and the service loop's
    handlers. `release()` is the publisher's release path (it takes the outbox's lock);
    `release_locked()` the same where the lock is already held (a late joiner's state)."""

    def __init__(self, *, interest: Interest, held: HeldEvents, outbox: Outbox,
                 stats: PublisherStats, encoder: EventEncoder, limits: Limits, curve,
                 release, release_locked, capped: bool | None = None) -> None:
        self.interest, self.held, self.outbox, self.stats = interest, held, outbox, stats
        self.late_join = LateJoin(encoder, interest, held, outbox.lock, stats, limits, curve,
                                  release_locked, self.track, self.beat)
        self._curve, self._release = curve, release
        self.refusal_sources: list[Callable[[], dict[str, int]]] = []  # besides stats
        self._cut = threading.Event()  # the proxy thread's cue to drop every events connection
        self._revocation: RevocationCut | None = None
        self._threads: list[threading.Thread] = []
        self._caps: dict[str, ConnectionCap] = {}
        # subscriptions capped by connection: by default with keys, where a monitor key is
        # trusted with less than the run (events_proxy). The proxy thread's alone; None:
        # libzmq's proxy, whose subscriptions `_flood` bounds by their number in force
        capped = curve is not None if capped is None else capped
        self._subscriptions = SubscriptionCap() if capped else None
        self._flood: FloodCut | None = None  # this thread's, made with the events socket's cap

    def start(self, ctx: zmq.Context, inproc: str, host: str, events_port: int,
              state_port: int, queue_size: int, subscriber_hwm: int) -> dict[str, str]:
        """Bind the public sockets, connect the outbox, start the proxy and service
        threads; the endpoints."""
        # sndhwm 0: no subscription passed upstream is lost (the watcher counts them)
        front = _socket(ctx, zmq.XSUB, rcvhwm=1, sndhwm=0)
        front.bind(inproc)
        back = _socket(ctx, zmq.XPUB, sndhwm=subscriber_hwm, linger=0,
                       maxmsgsize=MAX_SUBSCRIPTION_BYTES,  # a longer one is no subscription
                       **(CAPPED_OPTIONS if self._subscriptions is not None else PUBLIC_OPTIONS))
        router = _socket(ctx, zmq.ROUTER, maxmsgsize=request_socket_cap(self.late_join.limits),
                         linger=0, rcvhwm=STATE_RCVHWM)
        # monitors before binding: every connection is seen (read here; the events socket's
        # by the proxy's thread where it files subscriptions by connection)
        self._caps = {"events": ConnectionCap(back), "state": ConnectionCap(router)}
        if self._subscriptions is None:
            self._flood = FloodCut(self._caps["events"])
        events = self._bind(back, host, events_port)
        state = self._bind(router, host, state_port)
        watcher = ctx.socket(zmq.XPUB)
        watcher.connect(inproc)
        proxy_ctl, self._proxy_ctl = _pair(ctx, inproc + "-proxy")
        stop, self._stop_ctl = _pair(ctx, inproc + "-stop")
        if self._curve is not None:
            self._revocation = RevocationCut(self._curve.access, self._cut, self._proxy_ctl)
        self.outbox.connect(ctx, inproc, queue_size)
        self._threads = [
            threading.Thread(target=run_events_proxy, daemon=True, name="offloop-proxy",
                             args=(front, back, proxy_ctl, self._cut, events, self._caps["events"],
                                   self._subscriptions)),
            threading.Thread(target=self._run, daemon=True, name="offloop-publisher",
                             args=(watcher, router, stop)),
        ]
        for thread in self._threads:
            thread.start()
        return {"events": events, "state": state}

    def _bind(self, sock: zmq.Socket, host: str, port: int) -> str:
        """A public socket: a CURVE server with keys, bound on the publisher's host."""
        if self._curve is not None:
            self._curve.apply(sock)
        sock.bind(f"tcp://{host}:{port or '*'}")
        return sock.last_endpoint.decode()

    def stop(self, linger: float) -> None:
        """Final heartbeats for `linger` seconds, then stop both threads."""
        self._stop_ctl.send(str(linger).encode())
        self._threads[1].join(timeout=linger + 5)
        self._proxy_ctl.send(b"TERMINATE")
        self._threads[0].join(timeout=5)
        for sock in (self._stop_ctl, self._proxy_ctl):
            sock.close(linger=0)

    @property
    def alive(self) -> bool:
        """Whether the service thread runs."""
        return len(self._threads) == 2 and self._threads[1].is_alive()

    def _run(self, watcher: zmq.Socket, router: zmq.Socket, stop: zmq.Socket) -> None:
        """Serve until `stop` receives the final heartbeats' linger, in seconds."""
        budget = RequestBudget()  # the state socket's share of the CPU

        def answer(sock: zmq.Socket) -> None:
            with budget.round():
                self.late_join.answer(sock, watcher, budget)

        handlers = {watcher: self.track, router: answer, stop: self._final_beats,
                    **{cap.monitor: self._connections for cap in self._monitored()}}
        poller, quiet = zmq.Poller(), zmq.Poller()  # quiet: while the budget rests
        for sock in handlers:
            poller.register(sock, zmq.POLLIN)
            if sock is not router:
                quiet.register(sock, zmq.POLLIN)
        interval = self.outbox.heartbeat_interval
        next_beat = time.monotonic()
        try:
            while True:
                now = time.monotonic()
                if now >= next_beat:  # the heartbeat timer
                    self.beat()
                    self._cut_revoked()
                    next_beat = now + interval
                wait = max(0.0, next_beat - time.monotonic())
                if self.held.holding:  # the stall timer
                    wait = min(wait, STALL_CHECK)
                ready = budget.poll(poller, quiet, wait)
                self._tick()
                for sock, _ in ready:
                    if handlers[sock](sock):
                        return
        finally:
            router.disable_monitor()  # this thread's socket; the proxy's monitor just closes
            for sock in handlers:
                sock.close(linger=0)

    def track(self, watcher: zmq.Socket) -> None:
        """Take in the (un)subscriptions waiting at the watcher."""
        interest, flood = self.interest, self._flood
        while watcher.poll(0):
            interest.change(watcher.recv())
            if flood is not None:
                flood.check(interest.in_force)
        interest.settle()

    def beat(self, final: bool = False) -> None:
        """One heartbeat, sent under the outbox's lock: it leaves behind every event
        numbered before it, so no subscriber counts those lost while they are queued."""
        with self.outbox.lock:
            self.stats.beats += 1
            self.outbox.beat(self.held.seq, self.held.tseq, self.stats.beats, final,
                             self.refusals())

    def _tick(self) -> None:
        """Held events the loop has not released for a while (it is stuck in a data loader,
        a long eval step, user code) leave from here; released ones are folded, off the loop."""
        if self.held.stalled(STALL_CHECK):
            self._release()
        if self.held.unfolded:
            with self.outbox.lock:
                self.held.fold()

    def _final_beats(self, stop: zmq.Socket) -> bool:
        """Several final heartbeats, FINAL_BEAT_GAP apart for the linger, so one lost to a
        full subscriber queue is not the last; ended early once no subscriber is connected,
        since no one is left to hear one (the trainer's own workers leave on the first)."""
        linger = float(stop.recv())
        deadline = time.monotonic() + linger
        connections = self._caps["events"]
        while True:
            self.beat(final=True)
            if not connections.live or time.monotonic() >= deadline:
                return True
            next_beat = min(deadline, time.monotonic() + FINAL_BEAT_GAP)
            while connections.live and (wait := next_beat - time.monotonic()) > 0:
                time.sleep(min(wait, _LIVE_CHECK))
                self._connections(None)  # the monitors this thread reads; the proxy's, its own

    def refusals(self) -> dict[str, int]:
        """What the run's sockets refused from peers so far, by kind: the publisher's and
        each of `refusal_sources`', those at 0 left out."""
        self.stats.events_connections_cut = self._caps["events"].cut
        if self._subscriptions is not None:
            self.stats.subscriptions_refused = self._subscriptions.refused
        elif self._flood is not None:
            self.stats.subscriptions_refused = self._flood.cut
        counts = self.stats.refusals()
        for source in self.refusal_sources:
            counts.update(source())
        return {what: n for what, n in counts.items() if n}

    def _monitored(self) -> list[ConnectionCap]:
        """The caps whose monitors this thread reads."""
        return [cap for name, cap in self._caps.items()
                if name == "state" or self._subscriptions is None]

    def _connections(self, _monitor: zmq.Socket) -> None:
        """Connections to the state socket (and the events socket's, when this thread
        reads its monitor): past MAX_CONNECTIONS each, cut."""
        for cap in self._monitored():
            _, closed = cap.take()
            if self._flood is not None and cap is self._flood.connections:
                self._flood.closed(closed)
        self.stats.state_connections_cut = self._caps["state"].cut

    def _cut_revoked(self) -> None:
        """A key that lost its role keeps no events connection (events_proxy.RevocationCut)."""
        if self._revocation is not None and self._revocation.check():
            self.stats.cuts += 1


def _socket(ctx: zmq.Context, kind: int, **options) -> zmq.Socket:
    sock = ctx.socket(kind)
    for name, value in options.items():
        setattr(sock, name, value)
    return sock


def _pair(ctx: zmq.Context, endpoint: str) -> tuple[zmq.Socket, zmq.Socket]:
    """Two PAIR sockets over inproc: (the bound one, the connected one)."""
    bound, connected = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    bound.bind(endpoint)
    connected.connect(endpoint)
    return bound, connected
