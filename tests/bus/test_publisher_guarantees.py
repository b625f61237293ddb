"""The publisher's numbering and heartbeat cadence at their edges (tests that kill mutants
of bus/publisher.py): every event carries the next sequence number, held or not, and a
heartbeat comes every interval, so tail loss is found that soon."""

from __future__ import annotations

import time

import pytest
from helpers.waiting import wait_until

from offloop.bus import Publisher, Subscriber


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
        assert sub.stats.gaps == 0 and publisher.beats >= 10
