"""Request and reply bodies (DEALER/ROUTER): the late-join state, run info and control
requests, and their replies (state, info, ack, error). Each is one msgpack map with a
version and a kind, checked against the kind's schema; nothing is pickled, and
untrusted bytes decode within `Limits` or raise `WireError`.
"""

from __future__ import annotations

import re
from typing import Any

import msgpack

from offloop.bus.errors import WireError
from offloop.bus.wire.values import (
    DEFAULT_LIMITS,
    VERSION,
    Limits,
    _frame_bytes,
    _require,
    _unpack,
    check_values,
)

#: Request kinds and the fields each must carry (a map may carry more: adding a field is
#: not a version change). `check_request` adds what a type alone does not say.
REQUEST_SCHEMAS: dict[str, dict[str, Any]] = {
    "state_req": {"k": str},
    "info_req": {"k": str},
    "ctl": {"k": str, "client": str, "req": int, "op": str, "args": dict, "t": float},
}
#: The args of each control op that has them: field -> (type, required).
CONTROL_ARGS: dict[str, dict[str, tuple[type, bool]]] = {
    "halt": {"reason": (str, True)},
    "checkpoint": {"tag": (str, True), "filename": (str, False)},
}
_PLAIN_FILE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}")
REPLY_SCHEMAS: dict[str, dict[str, Any]] = {
    "state": {"k": str, "run": str, "pub": str, "seq": int, "tseq": dict, "beat": int,
              "config": dict, "entries": list},
    "info": {"k": str, "run": dict},
    "ack": {"k": str, "client": str, "req": int, "op": str, "ok": bool, "result": dict},
    # a checkpoint's state is copied and its file being written: the ack follows when durable
    "taken": {"k": str, "client": str, "req": int, "op": str, "result": dict},
    "error": {"k": str, "error": str},
}


def encode_request(kind: str, **fields: Any) -> bytes:
    """A request body: ``{v, k: kind, ...fields}``.

    - ``state_req {topics: [str] | nil}`` asks for the late-join state;
    - ``info_req {}`` asks for the run's run.json content;
    - ``ctl {client, req, op: "halt"|"checkpoint", args, t: float, wait: float (optional)}``
      is a control request (`wait`: how long its client waits for the answer):
      halt args ``{reason: str}``, checkpoint args ``{tag: str, filename: str (optional)}``.
    """
    if kind not in REQUEST_SCHEMAS:
        raise WireError(f"unknown request kind {kind!r}")
    return msgpack.packb({"v": VERSION, "k": kind, **fields}, default=_no_pickle)


def encode_reply(kind: str, **fields: Any) -> bytes:
    """A reply body: ``state``, ``info``, ``ack {client, req, op, ok, result, error}`` or
    ``error {error}`` (the answer to a request the server could not read)."""
    if kind not in REPLY_SCHEMAS:
        raise WireError(f"unknown reply kind {kind!r}")
    return msgpack.packb({"v": VERSION, "k": kind, **fields}, default=_no_pickle)


def _no_pickle(value: Any) -> Any:
    if hasattr(value, "item") and hasattr(value, "dtype"):
        return value.item()
    raise WireError(f"cannot encode {type(value).__name__} on the wire (not pickled, by design)")


def _decode_body(frame, schemas: dict, limits: Limits, what: str) -> dict:
    data = _frame_bytes(frame)
    if len(data) > limits.max_body_bytes:
        raise WireError(f"{what} is {len(data)} bytes, the limit is {limits.max_body_bytes}")
    return _check_body(_unpack(data, limits), schemas, what)


def _check_body(body: Any, schemas: dict, what: str) -> dict:
    if isinstance(body, dict):
        check_values(body)  # map keys str, no msgpack timestamp: anywhere in the body
    kind = body.get("k") if isinstance(body, dict) else None
    # an unhashable kind must not raise TypeError
    if not isinstance(kind, str) or kind not in schemas:
        raise WireError(f"{what} kind {kind!r} is not one of {sorted(schemas)}")
    return _require(body, schemas[kind], what)


def decode_request(frame, limits: Limits = DEFAULT_LIMITS) -> dict:
    """A request body, checked against its kind's schema and `check_request`; refused by
    its length before any byte is decoded, and by its containers' lengths while decoding,
    so that no request costs more than decoding `limits.max_request_bytes`."""
    data = _frame_bytes(frame)
    check_request_size(len(data), limits)
    request_limits = Limits(max_container_len=limits.max_request_items)
    return check_request(_check_body(_unpack(data, request_limits), REQUEST_SCHEMAS, "request"))


#: how many times `max_request_bytes` a ROUTER taking requests lets libzmq receive: a request
#: up to that is refused with an answer naming the limit; a larger one cuts its connection
REQUEST_TRANSPORT_FACTOR = 4


def request_socket_cap(limits: Limits = DEFAULT_LIMITS) -> int:
    """The maxmsgsize of a socket taking requests: libzmq buffers at most this much of a
    partial message per connection, and cuts a connection that sends more."""
    return REQUEST_TRANSPORT_FACTOR * limits.max_request_bytes


def check_request_size(size: int, limits: Limits = DEFAULT_LIMITS) -> None:
    """Refuse (WireError) a request body by its length alone."""
    if size > limits.max_request_bytes:
        raise WireError(f"request is {size} bytes, the limit is {limits.max_request_bytes}")


def check_request(body: dict) -> dict:
    """What a field's type alone does not say (WireError naming the field): a state_req
    carries `topics`, a list of str or nil (nil: every topic); a halt's or checkpoint's
    args are those of CONTROL_ARGS (an unknown op's args are not looked at: it is refused,
    ok false, whatever they are)."""
    kind = body["k"]
    if kind == "state_req":
        if "topics" not in body:
            raise WireError("state_req field 'topics' is missing, expected a list of str or nil "
                            "(nil: every topic)")
        topics = body["topics"]
        if topics is not None and not (type(topics) is list
                                       and all(type(t) is str for t in topics)):
            raise WireError(f"state_req field 'topics' is {topics!r}, "
                            "expected a list of str or nil")
    elif kind == "ctl":
        wait = body.get("wait")
        if wait is not None and not (type(wait) is float and wait > 0):
            raise WireError(f"ctl field 'wait' is {wait!r}, expected a float > 0 or nil "
                            "(or no field)")
        fields = CONTROL_ARGS.get(body["op"], {})
        args = body["args"]
        for name, (expected, required) in fields.items():
            value = args.get(name)
            if type(value) is expected or value is None and not required:
                continue
            got = "missing" if name not in args else repr(value)
            raise WireError(f"{body['op']} args field {name!r} is {got}, expected "
                            f"{expected.__name__}{'' if required else ' or nil (or no field)'}")
    return body


def control_refusal(op: str, args: dict) -> str | None:
    """Why a well-formed control request is refused at once (ok false), or None: a
    checkpoint file name that is not a plain file name (letters, digits, '.', '-', '_', not
    starting with '.', at most 100 characters), which would leave the checkpoint folder."""
    if op == "checkpoint":
        name = args.get("filename")
        if name is not None and not _PLAIN_FILE_NAME.fullmatch(name):
            return (f"checkpoint filename {name!r} must be a plain file name "
                    "(letters, digits, '.', '-', '_')")
    return None


def decode_reply(frame, limits: Limits = DEFAULT_LIMITS) -> dict:
    return _decode_body(frame, REPLY_SCHEMAS, limits, "reply")


#: the longest routing identity libzmq gives or accepts (ZMQ_ROUTING_ID)
MAX_IDENTITY_BYTES = 255


def split_envelope(frames: list) -> tuple[list[bytes], Any] | None:
    """A request as a ROUTER receives it: (the routing envelope to answer to, the body),
    or None for any other layout. Two layouts are served: ``[peer, body]`` from a client's
    DEALER, and ``[relay, client, b"", body]`` from `offloop relay`'s DEALER, which names
    the client to route the answer back to (one hop, as ROUTER/DEALER proxies do)."""
    if len(frames) == 2:
        return [_as_bytes(frames[0])], frames[1]
    if len(frames) == 4 and len(frames[2]) == 0 and 0 < len(frames[1]) <= MAX_IDENTITY_BYTES:
        return [_as_bytes(f) for f in frames[:3]], frames[3]
    return None


def _as_bytes(frame) -> bytes:
    return frame.bytes if hasattr(frame, "bytes") else bytes(frame)
