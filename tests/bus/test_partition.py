"""A subscriber cut off from its publisher (a paused TCP link between them) waits the
silence out when told to, counts exactly what it lost, and takes the state again on heal,
folding in only the values it lost; without that wish it still gives up as before."""

from __future__ import annotations

import time

import pytest
from helpers.tcp_pause import publisher_behind_link

from offloop.bus import PublisherSilent, Subscriber

PAD = "x" * 1000
TOPICS = ["fit_start", "batch_end", "epoch_end"]


def recv_until(sub: Subscriber, predicate, timeout: float, what: str, got: list | None = None) -> list:
    """Messages `sub` delivers (appended to `got`) until `predicate()` holds; fails after
    `timeout` seconds."""
    got = [] if got is None else got
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        msg = sub.recv(timeout=0.05)
        if msg is not None:
            got.append(msg)
    return got


def accounted(sub: Subscriber, published: dict[str, int], got: list) -> bool:
    """Every event published is received or counted lost, and the resync is over: every
    value it folds in has been delivered."""
    live = [m for m in got if not m.from_state]
    if not sub.stats.resyncs or sub.resync_waiting or len(got) - len(live) != sub.stats.resynced:
        return False
    return all(sum(m.topic == t for m in live) + sub.stats.gaps_by_topic.get(t, 0) == n
               for t, n in published.items())


@pytest.fixture
def cut_off():
    """A publisher (a small per-subscriber queue, heartbeats every 0.1 s) and a subscriber
    that reaches it through a link the test can pause; the subscriber waits up to 30 s."""
    with publisher_behind_link(run_id="run", subscriber_hwm=50, heartbeat_interval=0.1) as (pub, link, probe):
        sub = Subscriber(link.endpoint, pub.endpoints["state"], topics=TOPICS,
                         heartbeat_timeout=0.5, give_up_after=30)
        yield pub, link, sub, probe
        sub.close()


def test_a_silence_is_waited_out_counted_exactly_and_resynced_with_only_what_was_lost(cut_off):
    pub, link, sub, probe = cut_off
    ts = (0, 0, 0, 0, 0)
    pub.publish("fit_start", ts, {"note": "before"})
    sub.connect(join_timeout=5)
    joined = sub.recv(timeout=5)
    assert joined.topic == "fit_start" and joined.from_state
    link.pause()
    got = recv_until(sub, lambda: sub.silent_since is not None, 5, "the silence to be reported")
    assert sub.stats.silences == 1 and sub.stats.resyncs == 0

    # far more than the kernel's buffers and the subscriber's queue hold: the newest are lost
    batches = 20_000
    for i in range(1, batches + 1):
        pub.publish("batch_end", (0, i, i, 0, 0), {"loss": float(i), "pad": PAD})
    pub.publish("epoch_end", (1, batches, 0, 0, 0), {"epoch": 1})
    published = {"batch_end": batches, "epoch_end": 1}  # since the join (fit_start came in its state)
    probe.past(pub.seq)  # a busy machine's proxy may still hold the newest
    link.resume()
    recv_until(sub, lambda: accounted(sub, published, got), 30, "every event accounted for", got)

    stats = sub.stats
    live = [m for m in got if not m.from_state]
    resynced = [m for m in got if m.from_state]
    # exact: each event delivered once or counted lost once, and some really were lost
    assert stats.duplicates == 0 and stats.gaps > 0
    assert stats.received + stats.gaps == sum(published.values())
    assert len({(m.topic, m.tseq) for m in live}) == len(live)
    assert sub.silent_since is None and stats.silences == 1 and stats.resyncs == 1
    recv_until(sub, lambda: not sub.catching_up, 5, "a heartbeat sent after the resync's state")
    assert sub.last_silence >= 0.5
    # the resync brought what was lost, once each and only that: the newest batch_end and
    # the epoch_end; not fit_start, which was received
    assert sorted((m.topic, m.tseq) for m in resynced) == [("batch_end", batches), ("epoch_end", 1)], (
        stats, [(m.topic, m.tseq) for m in live if m.topic != "batch_end"])
    assert stats.resynced == 2
    assert next(m for m in resynced if m.topic == "batch_end").data["loss"] == float(batches)
    # each value folded in is newer than every live event of its topic before it: a State
    # fed in this order only moves forward
    for m in resynced:
        before = [x.tseq for x in got[: got.index(m)] if x.topic == m.topic and not x.from_state]
        assert all(t < m.tseq for t in before)
        assert not any(x.topic == m.topic for x in got[got.index(m) + 1:])


def test_a_value_received_before_the_resync_is_not_delivered_again(cut_off):
    pub, link, sub, _ = cut_off
    sub.connect(join_timeout=5)
    link.pause()
    recv_until(sub, lambda: sub.silent_since is not None, 5, "the silence to be reported")
    pub.publish("epoch_end", (1, 1, 0, 0, 0), {"epoch": 1})  # fits every queue: arrives on heal
    link.resume()
    got: list = []
    recv_until(sub, lambda: sub.stats.heartbeats > 20 and accounted(sub, {"epoch_end": 1}, got),
               30, "the resync and two seconds of heartbeats", got)
    assert [(m.topic, m.from_state) for m in got] == [("epoch_end", False)]
    assert sub.stats.gaps == 0 and sub.stats.resynced == 0 and sub.stats.duplicates == 0


def test_a_silence_past_give_up_after_raises(cut_off):
    pub, link, sub, _ = cut_off
    sub.give_up_after = 1.5
    sub.connect(join_timeout=5)
    link.pause()
    start = time.monotonic()
    with pytest.raises(PublisherSilent, match="no heartbeat from .* for 1.5s"):
        recv_until(sub, lambda: False, 10, "PublisherSilent")
    assert 1.4 <= time.monotonic() - start < 5 and sub.stats.silences == 1


def test_without_give_up_after_a_silence_raises_at_the_heartbeat_timeout(cut_off):
    pub, link, *_ = cut_off
    sub = Subscriber(link.endpoint, pub.endpoints["state"], topics=TOPICS, heartbeat_timeout=0.5)
    try:
        sub.connect(join_timeout=5)
        link.pause()
        with pytest.raises(PublisherSilent, match="for 0.5s"):
            recv_until(sub, lambda: False, 10, "PublisherSilent")
        assert sub.stats.silences == 0
    finally:
        sub.close()


def test_give_up_after_shorter_than_the_heartbeat_timeout_is_refused():
    with pytest.raises(ValueError, match="give_up_after must be >= heartbeat_timeout"):
        Subscriber("tcp://127.0.0.1:1", heartbeat_timeout=5, give_up_after=1)
