"""A key that loses its role loses its events connection, and every other subscriber is
served again once it has reconnected: through a real publisher with keys (and a real
relay in front of it), their ZAP handlers and real subscribers."""

from __future__ import annotations

import contextlib
import os
import time

import pytest
import zmq
from helpers.waiting import wait_until

from offloop.bus import Publisher, RunInfo, Subscriber
from offloop.bus.relay import Relay
from offloop.bus.security import generate_keys, load_client_keys, load_server_keys

KEPT = ("ann", "bob", "cy", "dee")
REVOKED = ("eve", "mal")


def served_again(publisher: Publisher, subscriber: Subscriber, after: int, timeout: float) -> bool:
    """Whether `subscriber` hears a batch_start numbered past `after` within `timeout` s,
    the publisher publishing one every few milliseconds meanwhile."""
    deadline = time.monotonic() + timeout
    i = after
    while time.monotonic() < deadline:
        i += 1
        publisher.publish("batch_start", (0, i, i, i, 0), {"i": i})
        event = subscriber.recv(timeout=0.02)
        if event is not None and event.data["i"] > after:
            return True
    return False


@contextlib.contextmanager
def served(keys, through_relay: bool):
    """(the publisher, the endpoint subscribers connect to, what counts its cuts), with
    keys: the publisher's own events socket, or a relay's in front of it."""
    server = load_server_keys(keys)
    ctx = zmq.Context()
    auth = server.start_authenticator(ctx)
    publisher = Publisher("revoked-run", heartbeat_interval=0.1, context=ctx, curve=server)
    relay = None
    try:
        publisher.start()
        served_by = publisher
        if through_relay:
            info = RunInfo(publisher.run_id, "revoked", os.getpid(), time.time(), dict(publisher.endpoints),
                           curve_public=server.public.decode())
            relay = served_by = Relay(info, keys=load_server_keys(keys),
                                      upstream=load_client_keys(keys, "relay", server.public))
            relay.start()
        yield publisher, served_by.endpoints["events"], served_by.stats
    finally:
        if relay is not None:
            relay.close()
        publisher.close(linger=0)
        auth.stop()
        ctx.term()


@pytest.mark.parametrize("through_relay", [False, True], ids=["publisher", "relay"])
def test_after_a_revocation_every_other_subscriber_is_served_again_cut_after_cut(tmp_path, through_relay):
    # a cut rebinds the public socket; libzmq says nothing of the connections the unbind
    # closed and gives the new ones their descriptors again: a subscription from a
    # reconnected peer was taken for its old connection's and never filed, so that peer
    # heard nothing more (CI: a worker restarted, a monitor raised PublisherSilent), and
    # the prefixes of the connections gone stayed in force for ever
    keys = tmp_path / "keys"
    generate_keys(keys, "relay", role="monitor")
    for name in KEPT + REVOKED:
        generate_keys(keys, name, role="monitor")
    subs = []
    with served(keys, through_relay) as (publisher, endpoint, stats):
        try:
            def subscriber(name: str) -> Subscriber:
                sub = Subscriber(endpoint, topics=["batch_start"], curve=load_client_keys(keys, name),
                                 heartbeat_timeout=1, give_up_after=30)
                subs.append(sub)
                sub.connect()
                return sub

            kept = [subscriber(name) for name in KEPT]
            revoked = [subscriber(name) for name in REVOKED]
            wait_until(lambda: publisher.wants("batch_start"), 5, "the subscriptions")
            for sub in kept + revoked:
                assert served_again(publisher, sub, 0, 5)
            for cut, (name, gone) in enumerate(zip(REVOKED, revoked, strict=True), start=1):
                (keys / "authorized" / f"{name}.key").unlink()
                wait_until(lambda n=cut: stats.cuts == n, 10, f"cut {cut}")
                after = 1_000_000 * cut
                for sub in kept:
                    assert served_again(publisher, sub, after, 10), f"a kept subscriber unheard after cut {cut}"
                assert not served_again(publisher, gone, after, 2), f"{name} heard after her revocation"
        finally:
            for sub in subs:
                sub.close()
        # every subscriber gone: what they had filed is taken back, and the trainer stops
        # serialising what nobody wants (batch_start is no topic it retains)
        wait_until(lambda: not publisher.wants("batch_start"), 10, "batch_start wanted by no one")
