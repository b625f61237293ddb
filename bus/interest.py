"""Which topics the publisher serializes, and how each leaves: the subscriptions it has
seen, turned into sets the training thread tests with one C call.

Pure: no sockets. The service thread feeds it each (un)subscription message (`change`)
and then `settle()`s; the publishing thread asks `wants(topic)` and, for a topic it has
not published before, `opens(topic)`.
"""

from __future__ import annotations

import logging
import threading

from offloop.bus.events import RUN_TOPICS
from offloop.bus.publisher_stats import PublisherStats
from offloop.bus.wire import (
    BURST_PREFIX,
    BURSTS_OF_TOPICS,
    HEARTBEAT_TOPIC,
    MAX_TOPIC_BYTES,
    WANT_PREFIX,
    WireError,
    topic_prefix,
)

__all__ = ["Interest", "MAX_OPEN_PREFIXES", "check_topic"]

log = logging.getLogger("offloop.bus")

#: open topic prefixes (subscriptions not ending in a full topic) matched one by one on
#: the training thread; beyond this many, every topic is published (see settle())
MAX_OPEN_PREFIXES = 64
_HB_PREFIX = topic_prefix(HEARTBEAT_TOPIC)


class Interest:
    """The subscriptions in force, as the training thread reads them.

    `wanted` (the topics encoded when published) is changed in place, additions before
    removals, so `wants` is the set's own C `__contains__`, a call that costs no Python
    frame (an Event is a str of its value: it hashes and compares as its topic).
    `single` are the topics sent as messages of their own; `bursts` says bursts are
    sent, `everything` that a subscriber of everything takes them (with `in_bursts`,
    the topics subscribers of named topics take in bursts: `want_prefix`);
    `open_prefixes` select topics outside RUN_TOPICS, which join `wanted` the first
    time they are published (`opens`)."""

    def __init__(self, retained: frozenset[str], stats: PublisherStats) -> None:
        for topic in retained:
            check_topic(topic)
        self.retained = frozenset(retained)
        self.stats = stats
        self.wanted: set[str] = set(self.retained)
        self.wants = self.wanted.__contains__
        self.single: frozenset[str] = frozenset()
        self.bursts = self.everything = False
        self.in_bursts: frozenset[str] = frozenset()
        self.open_prefixes: tuple[str, ...] = ()
        self._single_prefixes: tuple[str, ...] = ()
        self._seen: set[str] = set()  # topics opened so far
        self._subscriptions: set[bytes] = set()  # SUB prefixes in force; service thread only
        # orders opens() (publishing thread) with settle() (service thread): neither may
        # undo the other's half
        self._lock = threading.Lock()

    @property
    def in_force(self) -> int:
        """Distinct SUB prefixes in force (service thread)."""
        return len(self._subscriptions)

    def opens(self, topic: str) -> bool:
        """A topic outside RUN_TOPICS that an open prefix selects: wanted from now on.
        Raises WireError for a reserved or malformed topic (nothing else checks them:
        every topic in `wanted` has been checked once)."""
        if not self.open_prefixes or not topic.startswith(self.open_prefixes):
            return False
        check_topic(topic)
        with self._lock:
            self._seen.add(topic)
            if self._single_prefixes and topic.startswith(self._single_prefixes):
                self.single = self.single | {topic}
            self.wanted.add(topic)  # last: where it goes is known before it is wanted
        return True

    def change(self, message: bytes) -> None:
        """One message a peer sent into the events socket: a subscription (b"\\x01" and a
        topic prefix) or an unsubscription (b"\\x00" ...); anything else is counted and
        changes no one's subscriptions. Takes effect at settle()."""
        if not message or message[0] not in (0, 1):
            self.stats.foreign_messages += 1
            return
        (self._subscriptions.add if message[0] == 1 else self._subscriptions.discard)(message[1:])

    def settle(self) -> None:
        """Recompute what is wanted, and how it leaves, from the subscriptions in force."""
        subscriptions = tuple(self._subscriptions)
        # b"", b"_", ... b"_burst\0" select bursts: every event, one message per burst
        everything = any(BURST_PREFIX.startswith(p) for p in subscriptions)
        # BURSTS_OF_TOPICS selects bursts too, holding the topics named by WANT_PREFIX (none
        # while no bursts are sent: no one would get them)
        bursts = everything or BURSTS_OF_TOPICS in subscriptions
        in_bursts = _topics_for(p[len(WANT_PREFIX):] for p in subscriptions
                                if p.startswith(WANT_PREFIX) and p.endswith(b"\0")) \
            if bursts else frozenset()
        per_topic = [p for p in subscriptions if p != _HB_PREFIX and p != BURSTS_OF_TOPICS
                     and not BURST_PREFIX.startswith(p) and not p.startswith(WANT_PREFIX)]
        prefixes = tuple(p.decode(errors="replace") for p in per_topic if not p.endswith(b"\0"))
        with self._lock:  # a topic opens() adds meanwhile is in `_seen` or added after
            seen = tuple(self._seen)
            single = _topics_for(per_topic)
            if prefixes:
                single |= {t for t in seen if t.startswith(prefixes)}
            wanted = self.retained | single | in_bursts
            if everything:
                wanted |= frozenset(RUN_TOPICS) | frozenset(seen)
            self.single, self._single_prefixes = frozenset(single), prefixes
            self.in_bursts, self.bursts, self.everything = in_bursts, bursts, everything
            # past MAX_OPEN_PREFIXES, matched as one, "everything" (the events socket still
            # filters per subscriber): a new topic's check stays one startswith
            crowded = len(prefixes) > MAX_OPEN_PREFIXES
            if crowded and not self.stats.prefix_overflow:
                log.warning("offloop: %d open topic prefixes subscribed (more than %d): every "
                            "topic is published from now on, and each subscriber's socket "
                            "filters", len(prefixes), MAX_OPEN_PREFIXES)
            self.stats.prefix_overflow = self.stats.prefix_overflow or crowded
            self.open_prefixes = ("",) if everything or crowded else prefixes
            current = self.wanted  # in place, one C call each: no wanted topic goes missing
            current |= wanted
            current -= current - wanted

    def covers(self, topics: list[str] | None) -> bool:
        """Whether a joiner's topics (None: everything, as bursts) are sent now."""
        if topics is None:
            return self.everything
        return self.single.union(self.in_bursts).issuperset(topics)


def check_topic(topic: str) -> None:
    """Raise WireError for a topic the wire reserves or cannot carry."""
    if not _valid_topic(topic):
        raise WireError(f"topic {topic[:64]!r} is empty, contains NUL, starts with '_' "
                        f"(reserved) or is over {MAX_TOPIC_BYTES} bytes long")


def _valid_topic(topic: str) -> bool:
    return (isinstance(topic, str) and bool(topic) and "\0" not in topic
            and not topic.startswith("_")
            and len(topic.encode(errors="replace")) <= MAX_TOPIC_BYTES)


def _topics_for(subscriptions) -> frozenset[str]:
    """The topics a set of SUB prefixes selects (b"" selects every topic)."""
    wanted: set[str] = set()
    for prefix in subscriptions:
        if prefix.endswith(b"\0"):
            topic = prefix[:-1].decode(errors="replace")
            if _valid_topic(topic):  # publish() checks only topics outside `wanted`
                wanted.add(topic)
        else:
            text = prefix.decode(errors="replace")
            wanted.update(t for t in RUN_TOPICS if t.startswith(text))
    return frozenset(wanted)
