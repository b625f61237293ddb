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

Without keys libzmq's own proxy files subscriptions, in C, and cannot say who sent which:
`FloodCut` bounds them there by their number in force, cutting the connection that has
sent the most (the service thread's, which counts them).
"""

from __future__ import annotations

import logging
import time
from enum import Enum

from offloop.bus.connection_cap import ConnectionCap
from offloop.bus.wire.values import MAX_TOPIC_BYTES, WANT_PREFIX

__all__ = ["FloodCut", "PER_PEER", "TOTAL", "SubscriptionCap", "Verdict"]

log = logging.getLogger("offloop.bus")

#: distinct prefixes one connection may have filed at once (offloop has about 40 topics,
#: and matches more than 64 open prefixes as one anyway: interest.py)
PER_PEER = 128
#: distinct prefixes filed at once over every connection: this many of the longest
#: topic's length keep the publisher's growth well under 64 MiB (docs/reliability.md)
TOTAL = 512
#: the longest prefix that can name a topic: the longest topic, the NUL that ends it, and
#: the mark of a topic taken in bursts (wire.want_prefix)
LONGEST_PREFIX = len(WANT_PREFIX) + MAX_TOPIC_BYTES + 1
#: seconds after a FloodCut's cut before it cuts another connection: libzmq takes back
#: what the first had filed meanwhile, and the count falls
CUT_GAP = 0.1
#: seconds past CUT_GAP a FloodCut waits for its last cut connection to close (it closes
#: within milliseconds; a guard)
_CLOSE_WAIT = 1.0


class Verdict(Enum):
    FILE = "file"  # file it for this connection and pass it upstream
    KNOWN = "known"  # this connection has it already: nothing to pass upstream
    IGNORE = "ignore"  # from a connection being cut: nothing to do
    REFUSE = "refuse"  # past TOTAL: counted, not filed
    CUT = "cut"  # past PER_PEER or longer than a topic: counted, the connection shut down


class SubscriptionCap:
    """Who holds which prefix: `opened`/`closed` from the socket's monitor, `subscribe`/
    `unsubscribe` for each message a connection sends, each after the monitor's news up to
    that message (events_proxy), since a descriptor is reused once its connection ends."""

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
        if fd in self._cut:
            return Verdict.IGNORE
        held = self._peers.setdefault(fd, set())
        if prefix in held:
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


class FloodCut:
    """More than TOTAL distinct prefixes in force at a socket whose subscriptions libzmq's
    own proxy files (a run without keys): the connection whose peer has sent the most
    bytes is cut, subscriptions being all a peer sends that way
    (`ConnectionCap.heaviest`), one connection at a time while the count stays over
    (`CUT_GAP` after the last cut, once that one has closed). libzmq then takes back
    everything it filed for that connection. A peer that floods is cut early in its flood
    and each time it returns; peers within TOTAL are never touched. `check()` and
    `closed()` come from the thread that reads the socket's monitor."""

    def __init__(self, connections: ConnectionCap, total: int = TOTAL,
                 gap: float = CUT_GAP) -> None:
        self.connections, self.total, self.gap = connections, total, gap
        self._cutting: int | None = None  # the last one cut's descriptor, until it closes
        self._next = 0.0  # monotonic time from which another may be cut
        #: connections cut for the subscriptions in force
        self.cut = 0

    def check(self, in_force: int) -> None:
        """`in_force` distinct prefixes are filed now: past `total`, cut the heaviest."""
        if in_force <= self.total:
            return
        now = time.monotonic()
        if now < self._next or self._cutting is not None and now < self._next + _CLOSE_WAIT:
            return
        fd = self.connections.heaviest()
        if fd is None:
            return
        self._cutting, self._next = fd, now + self.gap
        self.cut += 1
        if self.cut & (self.cut - 1) == 0:  # the 1st, 2nd, 4th, ...: a flood logs little
            log.warning("offloop: %d subscriptions in force on the events socket (more than %d): "
                        "cut the connection that sent the most (%d connections cut so far)",
                        in_force, self.total, self.cut)
        self.connections.cut_off(fd)

    def closed(self, fds: list[int]) -> None:
        """These connections ended (a descriptor is reused once its connection ends)."""
        if self._cutting in fds:
            self._cutting = None
