"""Wire format v2: msgpack bodies, raw tensor frames, bounded decoding.

Follows the ZeroMQ Guide's KVMsg: every message is documented frame by frame where
it is built (and in docs/protocol.md), one module per kind of message:

- `events`: an event or a heartbeat, alone (PUB/SUB);
- `bursts`: several events of one publisher in one message, for subscribers of everything;
- `requests`: request and reply bodies (late-join state, run info, control, acks);
- `values`: what any of them may hold (tensors as raw frames), `Limits`, `Message`.

Promise: nothing is pickled, and untrusted bytes either decode within fixed limits or
raise `WireError` — never anything else.
"""

from offloop.bus.errors import WireError
from offloop.bus.wire.bursts import decode_burst, entry_ts
from offloop.bus.wire.events import EventEncoder, decode_event, encode_heartbeat, event_frames
from offloop.bus.wire.requests import (
    check_request_size,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
    request_socket_cap,
    split_envelope,
)
from offloop.bus.wire.values import (
    BURST_PREFIX,
    BURST_TOPIC,
    BURSTS_OF_TOPICS,
    DEFAULT_LIMITS,
    HEARTBEAT_TOPIC,
    MAX_SUBSCRIPTION_BYTES,
    MAX_TOPIC_BYTES,
    VERSION,
    WANT_PREFIX,
    Limits,
    Message,
    TensorFrame,
    check_size,
    topic_prefix,
    want_prefix,
)

__all__ = [
    "BURST_PREFIX",
    "BURST_TOPIC",
    "BURSTS_OF_TOPICS",
    "DEFAULT_LIMITS",
    "HEARTBEAT_TOPIC",
    "MAX_SUBSCRIPTION_BYTES",
    "MAX_TOPIC_BYTES",
    "VERSION",
    "WANT_PREFIX",
    "EventEncoder",
    "Limits",
    "Message",
    "TensorFrame",
    "WireError",
    "check_request_size",
    "check_size",
    "decode_burst",
    "decode_event",
    "decode_reply",
    "decode_request",
    "encode_heartbeat",
    "encode_reply",
    "encode_request",
    "entry_ts",
    "event_frames",
    "request_socket_cap",
    "split_envelope",
    "topic_prefix",
    "want_prefix",
]
