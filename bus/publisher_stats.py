"""The publisher's counters, in one place: each room of the publisher counts into the
same object, and every reader (tests, benchmarks, the trainer's run summary) reads it."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PublisherStats", "REFUSAL_KINDS"]

#: every kind of refusal a run's heartbeats may count (Publisher.refusals): the control
#: server's, the trainer's (given up, outlived), the state socket's, the events socket's;
#: the Prometheus exporter serves each
REFUSAL_KINDS = ("control_malformed", "control_oversized", "control_unauthorized",
                 "control_refused", "control_overflow", "control_stale", "control_connections",
                 "control_given_up", "control_outlived",
                 "state_malformed", "state_unauthorized", "state_connections", "events_foreign",
                 "events_connections", "events_subscriptions")


@dataclass
class PublisherStats:
    """What a publisher has counted since it was made. Each field has one writer thread
    (named below); a reader on another thread sees a recent value."""

    #: events messages not sent: a full queue, or the byte bound (outbox; heartbeats carry it)
    drops: int = 0
    #: of `drops`, those refused by max_queued_bytes (outbox)
    byte_drops: int = 0
    #: bytes of large messages not yet handed to every subscriber's connection (outbox)
    queued_bytes: int = 0
    #: heartbeats sent (service thread)
    beats: int = 0
    #: held events left out at release: a value the wire cannot carry (releasing thread)
    unencodable: int = 0
    #: late-join state requests answered (service thread)
    state_requests: int = 0
    #: malformed or misdirected requests at the state socket (service thread)
    bad_requests: int = 0
    #: state and info requests refused: their key is no longer authorised (with keys)
    unauthorized: int = 0
    #: times every events connection was cut because a key lost its role (with keys)
    cuts: int = 0
    #: messages a peer sent into the events socket that were not (un)subscriptions
    foreign_messages: int = 0
    #: connections shut down at once because the state or the events socket already had
    #: MAX_CONNECTIONS (service thread)
    state_connections_cut: int = 0
    events_connections_cut: int = 0
    #: subscriptions not filed: past a connection's or the socket's cap (subscription_cap;
    #: copied from the events proxy's ledger at each heartbeat)
    subscriptions_refused: int = 0
    #: more than MAX_OPEN_PREFIXES open prefixes were subscribed at once, at some point
    prefix_overflow: bool = False

    def refusals(self) -> dict[str, int]:
        """What the state and events sockets refused, by kind."""
        return {"state_malformed": self.bad_requests, "state_unauthorized": self.unauthorized,
                "state_connections": self.state_connections_cut,
                "events_foreign": self.foreign_messages,
                "events_connections": self.events_connections_cut,
                "events_subscriptions": self.subscriptions_refused}
