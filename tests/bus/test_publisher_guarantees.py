"""The publisher's numbering and heartbeat cadence at their edges (tests that kill mutants
of bus/publisher.py): every event carries the next sequence number, held or not, and a
heartbeat comes every interval, so tail loss is found that soon."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from helpers.waiting import wait_until

from offloop.bus import Publisher, Subscriber
from offloop.bus.wire.values import BURST_PREFIX


@pytest.fixture
def publisher():
    pub = Publisher("guarantees", heartbeat_interval=0.1)
    pub.start()
    yield pub
    pub.close(linger=0.1)


def test_every_event_carries_the_next_sequence_number_held_or_not(publisher):
    with Subscriber(publisher.endpoints["events"], publisher.endpoints["state"],
                    topics=["batch_start", "batch_end"]) as sub:
        sub.connect()
        wait_until(lambda: publisher.wants("batch_end") and publisher.wants("batch_start"), 5,
                   "the subscription")
        first = publisher.seq
        for i in range(1, 4):  # one at a time
            publisher.publish("batch_start", (0, i, i, i, 0), {"i": i})
            publisher.publish("batch_end", (0, i, i, i, 0), {"i": i})
        publisher.hold(interval=60.0)  # then held, numbered when released
        for i in range(4, 6):
            publisher.publish("batch_start", (0, i, i, i, 0), {"i": i})
            publisher.publish("batch_end", (0, i, i, i, 0), {"i": i})
        publisher.release(stop_holding=True)
        got = [sub.recv(timeout=5) for _ in range(10)]
    assert [m.seq for m in got] == list(range(first + 1, first + 11))
    assert [(m.topic, m.tseq) for m in got] == [(t, i) for i in range(1, 6) for t in ("batch_start", "batch_end")]
    assert publisher.seq == first + 10


def test_a_heartbeat_comes_every_interval_and_carries_the_latest_sequence_number(publisher):
    with Subscriber(publisher.endpoints["events"], publisher.endpoints["state"], topics=["batch_end"]) as sub:
        sub.connect()
        publisher.publish("batch_end", (0, 1, 1, 1, 0), {})
        assert sub.recv(timeout=5).seq == publisher.seq
        beats, started = sub.stats.heartbeats, time.monotonic()
        # 10 beats at 0.1 s take 1 s; a publisher that beat only once a second would need 10
        while sub.stats.heartbeats < beats + 10 and time.monotonic() - started < 5:
            sub.recv(timeout=0.05)
        assert sub.stats.heartbeats >= beats + 10, "fewer than 10 heartbeats in 5 s at an interval of 0.1 s"
        assert sub.stats.gaps == 0 and publisher.stats.beats >= 10


def _peer_sends(endpoint: str, message: bytes) -> None:
    """A local peer of another process sends one raw message into the events socket (an
    XSUB sends what it is given upstream: a subscription or anything else)."""
    code = ("import sys, time, zmq\n"
            "ctx = zmq.Context(); peer = ctx.socket(zmq.XSUB); peer.connect(sys.argv[1])\n"
            "peer.send(sys.stdin.buffer.read()); time.sleep(0.5)\n")
    # its exit status is not looked at: libzmq may crash the sender whose oversize message
    # made the publisher cut it off (seen with pyzmq 27); the publisher is what is tested
    subprocess.run([sys.executable, "-c", code, endpoint], input=message, capture_output=True, timeout=30)


def test_a_message_that_is_not_a_subscription_changes_no_subscription_and_is_counted(publisher):
    with Subscriber(publisher.endpoints["events"], publisher.endpoints["state"]) as sub:  # every event: bursts
        sub.connect()
        wait_until(lambda: publisher.wants("batch_end"), 5, "the subscription")
        _peer_sends(publisher.endpoints["events"], b"X" + BURST_PREFIX)  # read as "unsubscribe" before
        wait_until(lambda: publisher.stats.foreign_messages == 1, 5, "the foreign message counted")
        assert publisher.wants("batch_end")
        publisher.publish("batch_end", (0, 1, 1, 1, 0), {"i": 1})
        assert sub.recv(timeout=5).data == {"i": 1}
        # longer than any subscription: libzmq cuts the peer off before buffering it
        _peer_sends(publisher.endpoints["events"], b"\x01" + b"x" * (8 << 20))
        publisher.publish("batch_end", (0, 2, 2, 2, 0), {"i": 2})
        assert sub.recv(timeout=5).data == {"i": 2}
        assert publisher.stats.foreign_messages == 1 and publisher.wants("batch_end")


def test_many_open_prefixes_are_matched_as_one_and_a_subscriber_still_gets_its_topic(publisher):
    import zmq

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(publisher.endpoints["events"])
    try:
        for i in range(100):  # open prefixes: not whole topics
            sub.setsockopt(zmq.SUBSCRIBE, f"zz{i}".encode())
        sub.setsockopt(zmq.SUBSCRIBE, b"cust")
        wait_until(lambda: publisher.stats.prefix_overflow, 5, "the prefixes to be tracked")
        assert publisher.interest.open_prefixes == ("",)  # one startswith on the training thread, not 101
        for _ in range(50):  # until the subscription has reached the events socket
            publisher.publish("custom_metric", (0, 1, 1, 1, 0), {"x": 1})
            if sub.poll(100):
                break
        frames = sub.recv_multipart()
        assert frames[0].startswith(b"custom_metric")
        publisher.publish("other_topic", (0, 1, 1, 1, 0), {"x": 2})  # published, filtered by the socket
        assert not sub.poll(300)
    finally:
        sub.close(linger=0)
        ctx.term()


def test_a_backlog_of_late_join_requests_is_answered_in_rounds_with_one_settle_wait_each(publisher, monkeypatch):
    import zmq

    import offloop.bus.late_join as module
    from offloop.bus.wire import encode_request

    settles = []
    real_sleep = module.time.sleep
    monkeypatch.setattr(module.time, "sleep", lambda s: (settles.append(s), real_sleep(s))[1])
    publisher.publish("batch_end", (0, 1, 1, 1, 0), {"i": 1})
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(publisher.endpoints["state"])
    try:
        for _ in range(200):
            dealer.send(encode_request("state_req", topics=None))
        replies = 0
        while replies < 200 and dealer.poll(10_000):
            frames = dealer.recv_multipart()
            replies += 1
        assert replies == 200 and publisher.stats.state_requests == 200
    finally:
        dealer.close(linger=0)
        ctx.term()
    waits = [s for s in settles if s == module.SUBSCRIPTION_SETTLE]
    assert len(waits) <= 20  # one a round of up to STATE_BATCH (64), not one a request (200 before)
    assert frames  # each answer a whole state: header then its entries
