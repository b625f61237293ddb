"""Request and reply bodies (DEALER/ROUTER): the late-join state, run info and control
requests, and their replies (state, info, ack, error). Each is one msgpack map with a
version and a kind, checked against the kind's schema; nothing is pickled, and
untrusted bytes decode within `Limits` or raise `WireError`.
"""

from __future__ import annotations

from typing import Any

import msgpack

from offloop.bus.errors import WireError
from offloop.bus.wire.values import DEFAULT_LIMITS, VERSION, Limits, _frame_bytes, _require, _unpack

#: Request kinds and the fields each must carry.
REQUEST_SCHEMAS: dict[str, dict[str, Any]] = {
    "state_req": {"k": str},
    "info_req": {"k": str},
    "ctl": {"k": str, "client": str, "req": int, "op": str, "args": dict},
}
REPLY_SCHEMAS: dict[str, dict[str, Any]] = {
    "state": {"k": str, "run": str, "pub": str, "seq": int, "tseq": dict, "beat": int,
              "config": dict, "entries": list},
    "info": {"k": str, "run": dict},
    "ack": {"k": str, "client": str, "req": int, "op": str, "ok": bool, "result": dict},
    "error": {"k": str, "error": str},
}


def encode_request(kind: str, **fields: Any) -> bytes:
    """A request body: ``{v, k: kind, ...fields}``.

    - ``state_req {topics: [str] | nil}`` asks for the late-join state;
    - ``info_req {}`` asks for the run's run.json content;
    - ``ctl {client, req, op: "halt"|"checkpoint", args, t}`` is a control request.
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
    body = _unpack(data, limits)
    kind = body.get("k") if isinstance(body, dict) else None
    if not isinstance(kind, str) or kind not in schemas:  # an unhashable kind must not raise TypeError
        raise WireError(f"{what} kind {kind!r} is not one of {sorted(schemas)}")
    return _require(body, schemas[kind], what)


def decode_request(frame, limits: Limits = DEFAULT_LIMITS) -> dict:
    return _decode_body(frame, REQUEST_SCHEMAS, limits, "request")


def decode_reply(frame, limits: Limits = DEFAULT_LIMITS) -> dict:
    return _decode_body(frame, REPLY_SCHEMAS, limits, "reply")
