"""offloop's event bus: wire format, publisher, subscriber, control channel, discovery.

`bus` imports neither `trainer` nor `workers`; both import it.
"""

from offloop.bus.control import Ack, ControlRequest, ControlServer
from offloop.bus.control_client import ControlClient
from offloop.bus.discovery import (
    RunInfo,
    default_runs_root,
    find_run,
    list_runs,
    mark_finished,
    read_run_info,
    write_run_info,
)
from offloop.bus.duration import DurationError, Time, TimeUnit
from offloop.bus.errors import (
    BusError,
    ControlTimeout,
    PublisherSilent,
    ReadOnlyError,
    RunNotFound,
    WireError,
)
from offloop.bus.events import (
    AWAITS,
    CHECKPOINT_SAVED,
    CHECKPOINT_TAKEN,
    CONTROL_REQUEST,
    DECISION_EVENTS,
    EVENT_TOPICS,
    GRAD_NORMS,
    RUN_TOPICS,
    Event,
    Topic,
)
from offloop.bus.publisher import DEFAULT_RETAINED, Publisher
from offloop.bus.publisher_stats import REFUSAL_KINDS
from offloop.bus.subscriber import JoinState, Subscriber
from offloop.bus.timestamp import Timestamp
from offloop.bus.wire import Limits, Message, TensorFrame

__all__ = [
    "AWAITS",
    "Ack",
    "BusError",
    "CHECKPOINT_SAVED",
    "CHECKPOINT_TAKEN",
    "CONTROL_REQUEST",
    "ControlClient",
    "ControlRequest",
    "ControlServer",
    "ControlTimeout",
    "DECISION_EVENTS",
    "DEFAULT_RETAINED",
    "DurationError",
    "EVENT_TOPICS",
    "GRAD_NORMS",
    "Event",
    "JoinState",
    "Limits",
    "Message",
    "Publisher",
    "REFUSAL_KINDS",
    "PublisherSilent",
    "RUN_TOPICS",
    "ReadOnlyError",
    "RunInfo",
    "RunNotFound",
    "Subscriber",
    "TensorFrame",
    "Time",
    "TimeUnit",
    "Timestamp",
    "Topic",
    "WireError",
    "default_runs_root",
    "find_run",
    "list_runs",
    "mark_finished",
    "read_run_info",
    "write_run_info",
]
