"""Callbacks' own state across a resume: Composer saves each callback's `state_dict()` in
its checkpoints; here the trainer never holds callback state, so each worker keeps it
itself, in a sidecar file beside every checkpoint: `<checkpoint>.callbacks-<worker>.json`,
the states as they were at `checkpoint_taken` (the step the checkpoint holds), written
(atomically) when the worker sees `checkpoint_saved` (the file durable), read when it sees
`after_load` of a Trainer resuming from that checkpoint. Only halt and checkpoint requests
travel back to the trainer.

A state is JSON (numbers, strings, lists, dicts; a Timestamp is stored as its counters);
one that is not is reported once, naming the callback, and that callback is left out of
the file, as is a callback that raises in state_dict()."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from offloop.bus import Timestamp
from offloop.bus.discovery import write_json_atomically

__all__ = ["stateful", "sidecar", "capture_states", "save_states", "load_states", "FORMAT"]

FORMAT = "offloop-callback-state-1"
_TIMESTAMP = "__offloop_timestamp__"


def stateful(callbacks: list) -> bool:
    """Whether any callback keeps state across a resume (overrides state_dict)."""
    from offloop.workers.callback import Callback

    return any(getattr(type(c), "state_dict", Callback.state_dict) is not Callback.state_dict for c in callbacks)


def sidecar(checkpoint: str | os.PathLike, worker: int) -> Path:
    return Path(f"{checkpoint}.callbacks-{worker}.json")


def _encode(value: Any) -> Any:
    if isinstance(value, Timestamp):
        return {_TIMESTAMP: value.state_dict()}
    if isinstance(value, dict):
        return {str(k): _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool):
        return int(value)  # a Count (a timestamp counter) as the number it is
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {_TIMESTAMP}:
            return Timestamp.counted(*Timestamp.from_state_dict(value[_TIMESTAMP])._counters())
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def capture_states(callbacks: list, warned: set) -> list[dict[str, Any]]:
    """The callbacks' states now, as the JSON entries of a sidecar (taken when the trainer
    takes a checkpoint, written once its file is durable)."""
    entries = []
    for position, callback in enumerate(callbacks):
        name = type(callback).__name__
        try:
            # checked, and copied: what the callback changes after this moment is not saved
            state = json.loads(json.dumps(_encode(callback.state_dict()), allow_nan=True))
        except Exception as exc:
            if name not in warned:
                warned.add(name)
                print(f"offloop worker: {name}.state_dict() cannot be saved beside checkpoints ({exc!r}): "
                      "it must return JSON values (numbers, strings, lists, dicts, Timestamps); it will "
                      "start afresh on resume", file=sys.stderr, flush=True)
            continue
        if state:
            entries.append({"position": position, "name": name, "state": state})
    return entries


def save_states(checkpoint: str, worker: int, entries: list[dict[str, Any]]) -> Path | None:
    """Write captured states (capture_states()) beside `checkpoint`; None if its folder is gone."""
    path = sidecar(checkpoint, worker)
    if not path.parent.is_dir():
        return None
    return write_json_atomically(path, {"format": FORMAT, "checkpoint": Path(checkpoint).name, "callbacks": entries})


def load_states(checkpoint: str, worker: int, callbacks: list) -> int:
    """Give each callback its state from the sidecar of `checkpoint`; how many got one.
    A missing or unreadable sidecar, or one written for other callbacks, is reported
    and the callbacks start afresh."""
    path = sidecar(checkpoint, worker)
    try:
        saved = json.loads(path.read_text())
        if saved.get("format") != FORMAT:
            raise ValueError(f"not {FORMAT}")
    except FileNotFoundError:
        print(f"offloop worker: no callback state beside {checkpoint} ({path.name}): the callbacks "
              "start afresh", file=sys.stderr, flush=True)
        return 0
    except (OSError, ValueError) as exc:
        print(f"offloop worker: {path} is not readable callback state ({exc}): the callbacks start "
              "afresh", file=sys.stderr, flush=True)
        return 0
    restored = 0
    for entry in saved.get("callbacks", []):
        position, name = entry.get("position"), entry.get("name")
        if not isinstance(position, int) or not 0 <= position < len(callbacks) \
                or type(callbacks[position]).__name__ != name:
            print(f"offloop worker: {path.name} holds the state of a {name} at position {position}, which "
                  "this worker does not run: left out", file=sys.stderr, flush=True)
            continue
        callbacks[position].load_state_dict(_decode(entry["state"]))
        restored += 1
    return restored
