"""Late join: the state socket's answers. A subscriber that joins mid-run asks for the
run config and the latest event of each topic, and gets them with the counters that
number none of them twice; `offloop attach` and the relay ask for run.json here too.

Runs on the publisher's service thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import zmq

from offloop.bus.held import HeldEvents
from offloop.bus.interest import Interest
from offloop.bus.publisher_stats import PublisherStats
from offloop.bus.request_budget import RequestBudget
from offloop.bus.wire import (
    EventEncoder,
    Limits,
    WireError,
    decode_request,
    encode_reply,
    split_envelope,
)

__all__ = ["LateJoin", "STATE_BATCH", "SUBSCRIPTION_SETTLE"]

#: late-join requests answered together in one round of the service thread (one settle wait)
STATE_BATCH = 64
SUBSCRIPTION_SETTLE = 0.01  # seconds; libzmq's max_command_delay is 3M TSC ticks (~1 ms)
_JOIN_WAIT = 0.5  # seconds a state request waits for its joiner's subscriptions to be seen
#: run.json's fields an info request gets from a run without keys
_PUBLIC_INFO = frozenset({"run_id", "run_name", "pid", "started", "endpoints", "host", "finished",
                          "world_size", "ranks", "curve_public"})


class LateJoin:
    """Answers state, info and bad requests. `release` sends what is held (the caller
    holds the outbox's lock); `track` reads the subscriptions that wait at the watcher;
    `beat` sends one heartbeat."""

    def __init__(self, encoder: EventEncoder, interest: Interest, held: HeldEvents,
                 lock, stats: PublisherStats, limits: Limits, curve,
                 release: Callable[[], None], track: Callable[[zmq.Socket], None],
                 beat: Callable[[], None]) -> None:
        self.config: dict[str, Any] = {}  # what every late joiner receives first
        self.run_info: dict[str, Any] = {}  # run.json, for info requests
        self._encoder = encoder  # the service thread's own: the loop's encodes meanwhile
        self._interest, self._held, self._lock = interest, held, lock
        self._stats, self.limits, self._curve = stats, limits, curve
        self._release, self._track, self._beat = release, track, beat

    def answer(self, router: zmq.Socket, watcher: zmq.Socket, budget: RequestBudget) -> None:
        """Answer what waits at the state socket, STATE_BATCH requests a round: info and
        bad requests at once, the late-join requests together (one settle wait and one
        snapshot for all of them), so a backlog never holds up heartbeats or close()."""
        joiners: list[tuple[list[bytes], list[str] | None]] = []
        while len(joiners) < STATE_BATCH and router.poll(0):
            frames = router.recv_multipart(copy=False)
            budget.read(frames)
            split = split_envelope(frames)  # from a client, or relayed by `offloop relay`
            if split is None:
                self._refuse(router, [frames[0].bytes],
                             f"a request is one frame; got {len(frames) - 1}")
                continue
            envelope, body = split
            refusal = None if self._curve is None else \
                self._curve.access.refusal(body.get("User-Id"))
            if refusal:  # a key revoked after its connection was made
                self._stats.unauthorized += 1
                router.send_multipart([*envelope, encode_reply("error", error=refusal)])
                continue
            try:  # a state_req's topics are checked there; an info_req's others are not read
                request = decode_request(body, self.limits)
            except WireError as exc:
                self._refuse(router, envelope, str(exc))
                continue
            kind = request["k"]
            if kind == "state_req":
                self._stats.state_requests += 1
                joiners.append((envelope, request["topics"]))
            elif kind == "info_req":
                router.send_multipart([*envelope, encode_reply("info", run=self._info())])
            else:
                self._refuse(router, envelope, f"{kind!r} is not served on the state socket")
        if joiners:
            self._send_states(router, watcher, joiners)

    def _refuse(self, router: zmq.Socket, envelope: list[bytes], why: str) -> None:
        self._stats.bad_requests += 1
        router.send_multipart([*envelope, encode_reply("error", error=why)])

    def _send_states(self, router: zmq.Socket, watcher: zmq.Socket, joiners: list) -> None:
        # Each joiner's topics must be in the wanted set before its state is taken, or what
        # is published after the state would be numbered and not sent (counted lost): its
        # subscriptions reach the watcher through the proxy, which a busy machine delays.
        self._await_subscriptions(watcher, [topics for _, topics in joiners])
        # A joiner trusts this state only once it has received the heartbeat sent just
        # before it: it passed the publishing socket's filter, so the joiner's subscriptions
        # had reached that socket. The publishing socket gets time to apply them (libzmq
        # applies subscriptions on a send at most once per ~1 ms), so nothing published
        # after the state is filtered out.
        self._beat()
        self._track(watcher)
        time.sleep(SUBSCRIPTION_SETTLE)
        with self._lock:  # what is held leaves first: the state then has it
            self._release()
            snapshot = self._snapshot()
        for envelope, topics in joiners:
            router.send_multipart([*envelope, *self._frames(snapshot, topics)], copy=False)

    def _await_subscriptions(self, watcher: zmq.Socket, joiners: list[list[str] | None]) -> None:
        """Track subscriptions until every joiner's topics are sent, or _JOIN_WAIT has
        passed (a client that asks for the state without subscribing)."""
        deadline = time.monotonic() + _JOIN_WAIT
        while True:
            self._track(watcher)
            if all(map(self._interest.covers, joiners)):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                return
            watcher.poll(min(left, 0.05) * 1000)

    def _info(self) -> dict[str, Any]:
        """run.json for an authorised key; without keys any local account can ask, so only
        what connecting needs (and the config, which the late-join state carries anyway):
        not the run's folder, progress, checkpoints or who stopped it."""
        if self._curve is not None:
            return self.run_info
        info = {k: v for k, v in self.run_info.items() if k in _PUBLIC_INFO}
        if "extra" in self.run_info:
            info["extra"] = {"config": self.run_info["extra"].get("config", {})}
        return info

    def _snapshot(self) -> tuple:
        """Under the outbox's lock, where every numbered event is also the latest of its
        topic: the latest events, encoded, with counters that count none the state lacks."""
        held = self._held
        held.fold()
        entries = []
        for event in sorted(held.latest.values(), key=lambda event: event[1]):
            try:
                entries.append((event[0], self._encoder.encode_event(event)))
            except Exception:  # counted when it was released; a late joiner starts after it
                continue
        return held.seq, dict(held.tseq), self._stats.beats, entries

    def _frames(self, snapshot: tuple, topics: list[str] | None) -> list:
        """The late-join state: a header naming each entry's frame count, then the entries
        (those of `topics`, or all)."""
        seq, tseq, beats, entries = snapshot
        if topics is not None:
            wanted = set(topics)
            entries = [(topic, frames) for topic, frames in entries if topic in wanted]
        encoder = self._encoder
        header = encode_reply(
            "state", run=encoder.run, pub=encoder.pub, rank=encoder.rank, seq=seq, tseq=tseq,
            beat=beats, config=self.config, entries=[len(frames) for _, frames in entries],
        )
        out: list = [header]
        for _, frames in entries:
            out.extend(frames)
        return out
