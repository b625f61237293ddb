"""Publisher and subscriber over real sockets, with the other side in another process."""

from __future__ import annotations

import contextlib
import json
import time

import msgpack
import pytest
import torch
import zmq
from helpers.wire_values import deepest_alone, nested

from offloop.bus import Publisher, PublisherSilent, Subscriber, WireError
from offloop.bus.wire import EventEncoder


def wait_until(predicate, timeout=5.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


@contextlib.contextmanager
def every_and_one(publisher, topic):
    """Two joined subscribers: one of everything (bursts), one of `topic` alone (its own
    messages), once the publisher has seen both subscriptions."""
    with Subscriber(publisher.endpoints["events"], publisher.endpoints["state"], settle=0.2) as every, \
            Subscriber(publisher.endpoints["events"], publisher.endpoints["state"],
                       topics=[topic], settle=0.2) as one:
        every.connect()
        one.connect()
        wait_until(lambda: publisher._burst and topic in publisher._single)
        yield every, one


@pytest.fixture
def publisher():
    pub = Publisher("test-run", heartbeat_interval=0.1)
    pub.start()
    yield pub
    pub.close(linger=0.1)


def test_events_arrive_in_order_with_no_gaps(publisher):
    with Subscriber(publisher.endpoints["events"], publisher.endpoints["state"],
                    topics=["batch_end", "after_loss"]) as sub:
        sub.connect()
        for i in range(1, 501):
            publisher.publish("after_loss", (0, i, i, i, 0), {"loss": float(i)})
            publisher.publish("batch_end", (0, i, i, i, 0), {"i": i})
        got = []
        while len(got) < 1000:
            msg = sub.recv(timeout=5)
            assert msg is not None
            got.append(msg)
        assert [m.data["i"] for m in got if m.topic == "batch_end"] == list(range(1, 501))
        assert [m.seq for m in got] == sorted(m.seq for m in got)
        assert sub.stats.gaps == 0 and sub.stats.received == 1000


def test_events_nobody_subscribes_to_are_not_serialized(publisher):
    assert not publisher.wants("after_loss")
    assert publisher.wants("batch_end")  # retained for late joiners
    before = publisher.seq
    assert publisher.publish("after_loss", (0, 1, 1, 1, 0), {"loss": 1.0}) is False
    assert publisher.seq == before
    sub = Subscriber(publisher.endpoints["events"], topics=["after_loss"])
    sub.connect()
    wait_until(lambda: publisher.wants("after_loss"), what="subscription to reach the publisher")
    sub.close()
    wait_until(lambda: not publisher.wants("after_loss"), what="unsubscription")


def test_subscribing_to_everything_wants_every_event(publisher):
    with Subscriber(publisher.endpoints["events"]) as sub:
        sub.connect()
        wait_until(lambda: publisher.wants("before_forward") and publisher.wants("predict_end"))
        # a topic of the user's own, outside Composer's events, reaches it too
        assert publisher.publish("my_metric", (0, 1, 1, 1, 0), {"value": 3}) is True
        msg = sub.recv(timeout=5)
        assert msg is not None and msg.topic == "my_metric" and msg.data == {"value": 3}
    wait_until(lambda: not publisher.wants("my_metric"), what="unsubscription")
    assert publisher.publish("my_metric", (0, 2, 2, 2, 0), {"value": 4}) is False


def test_slow_subscriber_in_another_process_costs_the_publisher_nothing(spawn):
    total = 3000
    pub = Publisher("slow-run", heartbeat_interval=0.1, subscriber_hwm=50)
    endpoints = pub.start()
    try:
        child = spawn("slow_subscriber", endpoints["events"], endpoints["state"], total, 0.01)
        assert child.line()["joined"]
        wait_until(lambda: pub.wants("batch_end"))
        for i in range(1, total + 1):
            pub.publish("batch_end", (0, i, i, i, 0), {"i": i})
        # Every send has completed while the subscriber is still sleeping through its backlog.
        assert child.alive()
        report = child.line(timeout=60)
    finally:
        pub.close(linger=0.1)
    assert report["received"] < total  # it really fell behind
    assert report["received"] + report["gaps"] == total  # and counted exactly what it missed
    assert report["duplicates"] == 0


def test_late_joiner_gets_config_and_latest_of_every_topic_at_once(spawn):
    child = spawn("streaming_publisher", 30)
    endpoints = child.line()
    time.sleep(0.3)  # let the stream run ahead of the joiner
    sub = Subscriber(endpoints["events"], endpoints["state"], topics=["batch_end", "epoch_start"])
    start = time.monotonic()
    state = sub.connect(join_timeout=5)
    joined = time.monotonic() - start
    try:
        assert joined < 1.0, f"late join took {joined:.3f}s"
        assert state.config == {"model": "mlp", "lr": 0.01, "max_duration": "1ep"}
        topics = {m.topic: m for m in state.entries}
        assert topics["epoch_start"].data["note"].startswith("sent once")  # not waited for
        firsts = [sub.recv(timeout=2) for _ in state.entries]
        assert all(m.from_state for m in firsts) and {m.topic for m in firsts} == set(topics)
        seen = set()
        for _ in range(300):
            msg = sub.recv(timeout=2)
            assert msg is not None and not msg.from_state
            assert msg.tseq > topics[msg.topic].tseq  # nothing older than the state, twice
            assert (msg.topic, msg.tseq) not in seen
            seen.add((msg.topic, msg.tseq))
        assert sub.stats.gaps == 0
    finally:
        sub.close()


def test_silent_publisher_is_reported(spawn):
    child = spawn("streaming_publisher", 30)
    endpoints = child.line()
    sub = Subscriber(endpoints["events"], endpoints["state"], topics=["batch_end"],
                     heartbeat_timeout=0.5)
    sub.connect()
    assert sub.recv(timeout=2) is not None
    child.popen.kill()
    with pytest.raises(PublisherSilent, match="no heartbeat"):
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            sub.recv(timeout=0.1)
    sub.close()


def test_tail_loss_is_counted_from_heartbeats(publisher):
    sub = Subscriber(publisher.endpoints["events"], publisher.endpoints["state"],
                     topics=["batch_end"], settle=0.05)
    sub.connect()
    publisher.publish("batch_end", (0, 1, 1, 1, 0), {})
    assert sub.recv(timeout=2).tseq == publisher._tseq["batch_end"]
    # Messages the subscriber never sees: sent while it is not subscribed to them.
    publisher._wanted = publisher._wanted - {"batch_end"}
    publisher._retained = frozenset()
    hidden = Publisher.publish.__get__(publisher)
    publisher._tseq["batch_end"] += 5  # five sends lost in flight (as a full queue would)
    hidden("epoch_end", (0, 0, 0, 0, 0), {})
    deadline = time.monotonic() + 3
    while sub.stats.gaps == 0 and time.monotonic() < deadline:
        sub.recv(timeout=0.05)
    assert sub.stats.gaps == 5 and sub.stats.gaps_by_topic == {"batch_end": 5}
    sub.close()


def test_malformed_messages_from_a_rogue_publisher_are_counted_not_fatal():
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.PUB)
    port = rogue.bind_to_random_port("tcp://127.0.0.1")
    sub = Subscriber(f"tcp://127.0.0.1:{port}", heartbeat_timeout=10, context=ctx)
    sub._sub.subscribe(b"")
    sub._sub.connect(f"tcp://127.0.0.1:{port}")
    good = EventEncoder("r", "p", 0).encode("batch_end", 1, 1, (0, 0, 0, 0, 0), {})[0]
    bad = [[b"\xff"], [b"batch_end\0\xc1"], [b"batch_end\0" + msgpack.packb({"v": 9})],
           [good[:-3]], [good, b"extra frame"]]
    deadline = time.monotonic() + 5
    msg = None
    while msg is None and time.monotonic() < deadline:
        for frames in bad:
            rogue.send_multipart(frames)
        rogue.send(good)
        msg = sub.recv(timeout=0.1)
    assert msg is not None and msg.topic == "batch_end"
    assert sub.stats.malformed >= len(bad)
    sub.close()
    rogue.close(linger=0)
    ctx.term()


def test_publisher_queue_full_is_a_counted_drop():
    pub = Publisher("drop-run", queue_size=1, heartbeat_interval=0.1)
    pub.start()
    try:
        sub = Subscriber(pub.endpoints["events"], pub.endpoints["state"], topics=["batch_end"])
        sub.connect()
        sent = sum(pub.publish("batch_end", (0, i, i, i, 0), {"pad": b"x" * 4096})
                   for i in range(20000))
        assert pub.drops > 0 and sent + pub.drops == 20000
        deadline = time.monotonic() + 10
        while sub.stats.received + sub.stats.gaps < 20000 and time.monotonic() < deadline:
            sub.recv(timeout=0.1)
        assert sub.stats.received + sub.stats.gaps == 20000
        assert sub.stats.gaps >= pub.drops
        sub.close()
    finally:
        pub.close(linger=0.1)


def test_close_sends_final_heartbeat_and_subscriber_finishes(publisher):
    sub = Subscriber(publisher.endpoints["events"], publisher.endpoints["state"],
                     topics=["batch_end"], settle=0.05)
    sub.connect()
    publisher.publish("batch_end", (0, 1, 1, 1, 0), {})
    publisher.close(linger=0.2)
    got = []
    deadline = time.monotonic() + 5
    while not sub.finished and time.monotonic() < deadline:
        msg = sub.recv(timeout=0.1)
        if msg is not None:
            got.append(msg)
    assert sub.finished and sub.stats.gaps == 0
    assert json.dumps([m.topic for m in got if not m.from_state])  # delivered before finishing
    sub.close()


def test_held_events_leave_at_release_in_order_and_heartbeats_never_count_them_lost(publisher):
    with Subscriber(publisher.endpoints["events"], publisher.endpoints["state"],
                    topics=["batch_end"], settle=0.2) as sub:
        sub.connect()
        publisher.hold(interval=5.0)  # nothing leaves on its own for 5 s
        for i in range(1, 6):
            publisher.publish("batch_end", (0, i, i, i, 0), {"i": i})
        publisher.release_due()  # the interval has not passed: still held
        # several heartbeats (every 0.1 s) pass while they are held: none announces them
        assert sub.recv(timeout=0.6) is None
        assert sub.stats.gaps == 0
        publisher.release()
        got = [sub.recv(timeout=5) for _ in range(5)]
        assert [m.data["i"] for m in got] == [1, 2, 3, 4, 5]
        publisher.publish("batch_end", (0, 6, 6, 6, 0), {"i": 6})
        publisher.release(stop_holding=True)
        publisher.publish("batch_end", (0, 7, 7, 7, 0), {"i": 7})  # sent at once again
        assert [sub.recv(timeout=5).data["i"] for _ in range(2)] == [6, 7]
        time.sleep(0.5)  # heartbeats after the last event: still nothing counted lost
        assert sub.recv(timeout=0.1) is None and sub.stats.gaps == 0 and sub.stats.received == 7


def test_a_late_joiner_while_events_are_held_gets_them_in_its_state_and_nothing_twice(publisher):
    publisher.hold(interval=60.0)  # nothing leaves on its own for a minute
    for i in range(1, 4):
        publisher.publish("batch_end", (0, i, i, i, 0), {"i": i})
    assert publisher.seq == 0  # held events have no sequence numbers yet
    with Subscriber(publisher.endpoints["events"], publisher.endpoints["state"],
                    topics=["batch_end"], settle=0.2) as sub:
        state = sub.connect(join_timeout=5)  # the state request releases what is held first
        assert [(m.data["i"], m.tseq) for m in state.entries] == [(3, 3)]
        publisher.publish("batch_end", (0, 4, 4, 4, 0), {"i": 4})
        publisher.release()
        got = [sub.recv(timeout=2) for _ in range(2)]
        assert [(m.data["i"], m.from_state) for m in got] == [(3, True), (4, False)]
        time.sleep(0.5)  # heartbeats: the three released before the join are not lost to it
        assert sub.recv(timeout=0.1) is None and sub.stats.gaps == 0
    publisher.release(stop_holding=True)


def test_held_events_of_a_stalled_loop_leave_on_their_own_and_bursts_reach_subscribers_of_everything(
        publisher):
    with every_and_one(publisher, "batch_end") as (every, one):
        publisher.hold(interval=0.01)
        for i in range(1, 4):
            publisher.publish("batch_start", (0, i, i, i, 0), {"i": i})
            publisher.publish("batch_end", (0, i, i, i, 0), {"i": i, "t": torch.arange(i)})
        # the loop never calls release(): the publisher's own thread sends them (one burst)
        start = time.monotonic()
        got = [every.recv(timeout=2) for _ in range(6)]
        assert time.monotonic() - start < 1.0
        assert [(m.topic, m.data["i"]) for m in got] == [
            (topic, i) for i in range(1, 4) for topic in ("batch_start", "batch_end")]
        assert all(m.raw is None for m in got)  # they came in a burst, not one by one
        assert [m.data["t"].to_torch().tolist() for m in got if m.topic == "batch_end"] == [
            [0], [0, 1], [0, 1, 2]]
        mine = [one.recv(timeout=2) for _ in range(3)]
        assert [m.data["i"] for m in mine] == [1, 2, 3] and all(m.raw for m in mine)
        time.sleep(0.5)  # heartbeats after the burst: nothing counted lost, nothing twice
        assert every.recv(timeout=0.1) is None and one.recv(timeout=0.1) is None
        assert every.stats.gaps == one.stats.gaps == 0
        assert every.stats.duplicates == one.stats.duplicates == 0
        publisher.release(stop_holding=True)


def test_held_events_sharing_a_ts_keep_it_across_releases_for_bursts_topics_and_late_joiners(publisher):
    a, b = (0, 1, 1, 32, 0), (0, 2, 2, 64, 0)  # a step's events share one ts object
    with every_and_one(publisher, "after_loss") as (every, one):
        publisher.hold(interval=60.0)
        publisher.publish("batch_start", a, {"i": 1})
        publisher.publish("after_loss", a, {"i": 2})
        publisher.release()  # the next event shares its ts with one already sent
        publisher.publish("after_loss", a, {"i": 3})
        publisher.publish("batch_end", b)
        publisher.publish("batch_checkpoint", b)
        publisher.release()
        got = [every.recv(timeout=2) for _ in range(5)]
        assert [(m.topic, m.seq, m.tseq, m.ts, m.data) for m in got] == [
            ("batch_start", 1, 1, a, {"i": 1}), ("after_loss", 2, 1, a, {"i": 2}),
            ("after_loss", 3, 2, a, {"i": 3}), ("batch_end", 4, 1, b, {}), ("batch_checkpoint", 5, 1, b, {})]
        mine = [one.recv(timeout=2) for _ in range(2)]
        assert [(m.seq, m.tseq, m.ts, m.data) for m in mine] == [(2, 1, a, {"i": 2}), (3, 2, a, {"i": 3})]
    with Subscriber(publisher.endpoints["events"], publisher.endpoints["state"], settle=0.2) as late:
        state = late.connect(join_timeout=5)  # each topic's latest, with the ts it was held without
        assert {m.topic: (m.seq, m.tseq, m.ts) for m in state.entries} == {
            "batch_start": (1, 1, a), "after_loss": (3, 2, a), "batch_end": (4, 1, b),
            "batch_checkpoint": (5, 1, b)}
    publisher.release(stop_holding=True)


def test_reserved_topics_are_refused_and_unencodable_held_events_are_counted_not_raised(publisher):
    publisher._open_prefixes = ("",)  # as with a subscriber of everything
    for topic in ("_hb", "_burst", "_mine", "a\0b"):
        with pytest.raises(WireError):
            publisher.publish(topic, (0, 0, 0, 0, 0), {})
    with Subscriber(publisher.endpoints["events"], publisher.endpoints["state"], settle=0.1) as sub:
        sub.connect()
        publisher.hold(interval=5.0)
        ts = (0, 2, 2, 2, 0)  # the event after the bad one shares its ts: held without it
        publisher.publish("batch_end", (0, 1, 1, 1, 0), {"i": 1})
        publisher.publish("batch_end", ts, {"odd": object()})
        publisher.publish("batch_end", ts, {"i": 3})
        deep = nested(deepest_alone())  # fits in an event of its own, not in a burst
        publisher.publish("batch_end", ts, {"deep": deep})
        publisher.publish("batch_end", ts, {"i": 5})
        publisher.release()  # does not raise
        assert publisher.unencodable == 2
        got = [sub.recv(timeout=2) for _ in range(3)]
        assert [(m.data["i"], m.seq, m.tseq, m.ts) for m in got] == [
            (1, 1, 1, (0, 1, 1, 1, 0)), (3, 3, 3, ts), (5, 5, 5, ts)]
        deadline = time.monotonic() + 3
        while sub.stats.gaps == 0 and time.monotonic() < deadline:
            sub.recv(timeout=0.05)
        assert sub.stats.gaps == 2  # their sequence numbers were spent: counted lost
        publisher.release(stop_holding=True)


def test_an_event_member_is_published_under_its_topic(publisher):
    from offloop.bus import Event

    sub = Subscriber(publisher.endpoints["events"], publisher.endpoints["state"],
                     topics=["batch_end"], settle=0.05)
    sub.connect()
    assert publisher.wants(Event.BATCH_END) and publisher.publish(Event.BATCH_END, (0, 1, 1, 1, 0), {"loss": 1.0})
    msg = sub.recv(timeout=2)
    assert msg is not None and type(msg.topic) is str and msg.topic == "batch_end" and msg.data == {"loss": 1.0}
    sub.close()
