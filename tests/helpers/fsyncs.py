"""What a test's code fsyncs, by path: for the tests of durable writes (a file, then its
folder once the file has its name)."""

from __future__ import annotations

import os


def record_fsyncs(monkeypatch) -> list[str]:
    """From now on (the test's end), each os.fsync's path is appended to the list returned,
    and the fsync still happens."""
    synced: list[str] = []
    real = os.fsync

    def record(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", record)
    return synced
