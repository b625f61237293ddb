"""Heartbeats and events share one ordered path: a heartbeat never overtakes the events it
announces, so a subscriber never counts a queued event lost (and then duplicated)."""

from __future__ import annotations

import time

import zmq

from offloop.bus import Publisher, Subscriber
from offloop.bus.wire import decode_reply, encode_request, topic_prefix

EVENTS, ROUNDS = 50_000, 4


def test_a_heartbeat_never_overtakes_queued_events_so_nothing_is_counted_lost_or_twice():
    # Heartbeats every 0.5 ms while rounds of 50 000 events are sent flat out, every queue
    # unbounded (nothing can really be lost) and no settling time: a heartbeat that reached
    # the subscriber ahead of events sent before it would be counted as loss at once, and
    # the overtaken events, arriving later, as duplicates. (Through a heartbeat pipe of its
    # own, beside the events', this happened in most rounds.)
    pub = Publisher("hb-order", heartbeat_interval=0.0005, queue_size=10 * EVENTS, subscriber_hwm=0)
    endpoints = pub.start()
    sub = Subscriber(endpoints["events"], endpoints["state"], topics=["batch_end"], settle=0.0, rcvhwm=0)
    sent = 0
    try:
        sub.connect(join_timeout=10)
        deadline = time.monotonic() + 90
        for _ in range(ROUNDS):
            for i in range(sent + 1, sent + EVENTS + 1):
                assert pub.publish("batch_end", (0, i, i, i, 0), {"i": i})
            sent += EVENTS
            while sub.stats.received + sub.stats.gaps < sent and time.monotonic() < deadline:
                sub.recv(timeout=0.5)
            beats = sub.stats.heartbeats
            while sub.stats.heartbeats < beats + 3 and time.monotonic() < deadline:  # later beats settle
                sub.recv(timeout=0.5)
            assert (sub.stats.received, sub.stats.gaps, sub.stats.duplicates) == (sent, 0, 0)
    finally:
        sub.close()
        pub.close(linger=0.1)
    assert pub.stats.drops == 0 and sent == ROUNDS * EVENTS


def test_a_joiners_state_waits_until_its_topics_are_sent():
    # The state request arrives before the joiner's subscription: taken at once, its state
    # would let events published right after it be numbered but not sent (counted lost).
    pub = Publisher("join-order")
    endpoints = pub.start()
    ctx = zmq.Context()
    dealer, sub = ctx.socket(zmq.DEALER), ctx.socket(zmq.SUB)
    try:
        dealer.connect(endpoints["state"])
        dealer.send(encode_request("state_req", topics=["batch_end"]))
        assert not dealer.poll(100), "the state was taken before the joiner's topics were sent"
        sub.subscribe(topic_prefix("batch_end"))
        sub.connect(endpoints["events"])
        assert dealer.poll(10_000), "no state once the joiner subscribed"
        assert decode_reply(dealer.recv_multipart()[0])["k"] == "state"
        assert pub.publish("batch_end", (0, 1, 1, 8, 0), {"i": 1})  # right after the state: sent
        assert sub.poll(10_000), "the event published after the state never came"
    finally:
        dealer.close(linger=0)
        sub.close(linger=0)
        ctx.term()
        pub.close(linger=0.1)
