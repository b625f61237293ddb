"""At most so many subscriptions filed at a public events socket: PER_PEER distinct prefixes
a connection, TOTAL distinct prefixes in force at once.

libzmq files every prefix a peer subscribes in a trie per socket it passes through (the
public XPUB's, the proxy's XSUB's, the outbox's and the service thread's), at many bytes
of memory per byte of prefix, and keeps the memory after the peer leaves; it has no bound
of its own (docs/reliability.md). So where subscriptions are capped (with keys:
events_proxy), the public socket runs in ZMQ_XPUB_MANUAL mode: each subscription
reaches the events proxy's thread with the descriptor of the connection
that sent it (ZMQ_SRCFD), and is filed only if this ledger says so. A connection that asks
for more than PER_PEER, or for a prefix longer than any topic's (it could match nothing),
is cut (a monitor needs a handful, a relay one per topic in use); a subscription past TOTAL
is refused and counted, its connection kept.

The events proxy's thread owns one ledger and is its only caller.
"""

from __future__ import annotations

from enum import Enum

from offloop.bus.wire.values import MAX_TOPIC_BYTES, WANT_PREFIX

__all__ = ["PER_PEER", "TOTAL", "SubscriptionCap", "Verdict"]

#: distinct prefixes one connection may have filed at once (offloop has about 40 topics,
#: and matches more than 64 open prefixes as one anyway: interest.py)
PER_PEER = 128
#: distinct prefixes filed at once over every connection: this many of the longest
#: topic's length keep the publisher's growth well under 64 MiB (docs/reliability.md)
TOTAL = 512
#: the longest prefix that can name a topic: the longest topic, the NUL that ends it, and
#: the mark of a topic taken in bursts (wire.want_prefix)
LONGEST_PREFIX = len(WANT_PREFIX) + MAX_TOPIC_BYTES + 1


class Verdict(Enum):
    FILE = "file"  # file it for this connection and pass it upstream
    KNOWN = "known"  # this connection has it already: nothing to do
    REFUSE = "refuse"  # past TOTAL: counted, not filed
    CUT = "cut"  # past PER_PEER or longer than a topic: counted, the connection shut down


class SubscriptionCap:
    """Who holds which prefix: `opened`/`closed` from the socket's monitor, `subscribe`/
    `unsubscribe` for each message a connection sends. A connection's descriptor can be
    seen on a subscription before its ACCEPTED event (both arrive within microseconds); its
    entry is then made at the subscription."""

    def __init__(self, per_peer: int = PER_PEER, total: int = TOTAL) -> None:
        if per_peer < 1 or total < 1:
            raise ValueError(f"subscription caps must be at least 1, got {per_peer}, {total}")
        self.per_peer, self.total = per_peer, total
        self._peers: dict[int, set[bytes]] = {}  # descriptor -> the prefixes filed for it
        self._cut: set[int] = set()  # connections being shut down: what they send is ignored
        self._in_force: dict[bytes, int] = {}  # prefix -> connections that have it filed
        #: subscriptions not filed: past PER_PEER (and their connections cut) or past TOTAL
        self.refused = 0
        #: connections shut down for asking more than PER_PEER or a prefix past LONGEST_PREFIX
        self.cut = 0

    @property
    def in_force(self) -> int:
        """Distinct prefixes filed now."""
        return len(self._in_force)

    def opened(self, fd: int) -> None:
        self._peers.setdefault(fd, set())

    def closed(self, fd: int) -> set[bytes]:
        """The connection ended (libzmq drops what it filed for it): the prefixes it had."""
        self._cut.discard(fd)
        prefixes = self._peers.pop(fd, set())
        for prefix in prefixes:
            self._release(prefix)
        return prefixes

    def subscribe(self, fd: int, prefix: bytes) -> Verdict:
        held = self._peers.setdefault(fd, set())
        if prefix in held or fd in self._cut:
            return Verdict.KNOWN
        if len(held) >= self.per_peer or len(prefix) > LONGEST_PREFIX:
            self.refused += 1
            self.cut += 1
            self._cut.add(fd)
            return Verdict.CUT
        if prefix not in self._in_force and len(self._in_force) >= self.total:
            self.refused += 1
            return Verdict.REFUSE
        held.add(prefix)
        self._in_force[prefix] = self._in_force.get(prefix, 0) + 1
        return Verdict.FILE

    def unsubscribe(self, fd: int, prefix: bytes) -> bool:
        """Whether this connection had `prefix` filed (only then is it passed on: a peer
        cannot take away a subscription another holds)."""
        held = self._peers.get(fd)
        if held is None or prefix not in held:
            return False
        held.discard(prefix)
        self._release(prefix)
        return True

    def _release(self, prefix: bytes) -> None:
        left = self._in_force[prefix] - 1
        if left:
            self._in_force[prefix] = left
        else:
            del self._in_force[prefix]
