"""Recordings: a run's events as received, in a msgpack stream file, for offline replay.

Each record is one msgpack map, appended and flushed as it happens, so a recording
cut short (the worker killed) is still readable up to its last whole record::

    {v: 2, k: "recording", run, run_name, config, started}   first, once
    {k: "ev", f: [frame, ...]}     an event exactly as it came off the wire
    {k: "gap", topic, n, t}        n events of `topic` were lost here
    {k: "end", events, gaps}       written on a clean close
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import msgpack

from offloop.bus.errors import WireError
from offloop.bus.wire import DEFAULT_LIMITS, Limits, Message, decode_event

__all__ = ["RecordingWriter", "read_recording", "RecordingHeader"]

VERSION = 2  # the wire's: events are stored as they came off it


class RecordingWriter:
    """Appends records to a recording file; safe to read while it is being written."""

    def __init__(self, path: str | Path, run: str, run_name: str, config: dict[str, Any]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: BinaryIO = self.path.open("wb")
        self._packer = msgpack.Packer()
        self.events = self.gaps = 0
        self._write({"v": VERSION, "k": "recording", "run": run, "run_name": run_name,
                     "config": config, "started": time.time()})

    def _write(self, record: dict) -> None:
        self._file.write(self._packer.pack(record))
        self._file.flush()

    def event(self, frames: list) -> None:
        self.events += 1
        self._write({"k": "ev",
                     "f": [f.bytes if hasattr(f, "bytes") else bytes(f) for f in frames]})

    def gap(self, topic: str, n: int) -> None:
        self.gaps += n
        self._write({"k": "gap", "topic": topic, "n": n, "t": time.time()})

    def close(self) -> None:
        if not self._file.closed:
            self._write({"k": "end", "events": self.events, "gaps": self.gaps})
            self._file.close()


class RecordingHeader(dict):
    """The first record: run id and name, config, start time."""


def read_recording(path: str | Path, limits: Limits = DEFAULT_LIMITS
                   ) -> tuple[RecordingHeader, Iterator[Message | tuple[str, int]]]:
    """The header, and an iterator of Messages and ("gap", n) / ("gap:<topic>", n) items.

    Raises WireError if the file is not a recording. A record that cannot be read is
    ("malformed", 1) and the rest is still read; a truncated or corrupt tail ends the
    iterator with ("truncated", 1) (what was recorded before it is still replayed)."""
    path = Path(path)
    try:
        handle = path.open("rb")
    except OSError as exc:
        raise WireError(f"cannot open recording {path}: {exc.strerror or exc}") from None
    size = path.stat().st_size
    unpacker = msgpack.Unpacker(handle, max_buffer_size=limits.max_message_bytes,
                                strict_map_key=True)
    try:
        header = next(unpacker)
    except Exception:
        handle.close()
        raise WireError(f"{path} is not an offloop recording (no header)") from None
    if not isinstance(header, dict) or header.get("k") != "recording":
        handle.close()
        raise WireError(f"{path} is not an offloop recording")
    if header.get("v") != VERSION:
        handle.close()
        raise WireError(f"recording version {header.get('v')!r} is not supported "
                        f"(this build reads {VERSION})")

    def records() -> Iterator[Message | tuple[str, int]]:
        with handle:
            try:
                end = unpacker.tell()
                for record in unpacker:
                    end = unpacker.tell()  # where the last whole record ends
                    kind = record.get("k") if isinstance(record, dict) else None
                    if kind == "ev":
                        try:
                            msg = decode_event(record["f"], limits)
                        except (WireError, TypeError, ValueError, KeyError):
                            yield ("malformed", 1)  # not an event's frames
                            continue
                        msg.raw = record["f"]
                        yield msg
                    elif kind == "gap":
                        topic, n = record.get("topic", ""), record.get("n")
                        if type(topic) is not str or type(n) is not int or n < 0:
                            yield ("malformed", 1)  # said, and the replay goes on
                            continue
                        yield (f"gap:{topic}", n)
                    elif kind == "end":
                        return
                    else:
                        yield ("malformed", 1)
            except (ValueError, msgpack.OutOfData, msgpack.ExtraData, msgpack.FormatError,
                    msgpack.StackError):
                # corrupt from here: everything before this point was replayed
                yield ("truncated", 1)
                return
            if end < size:  # the file ends inside a record (a crash mid-write)
                yield ("truncated", 1)

    return RecordingHeader(header), records()
