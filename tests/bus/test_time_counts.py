"""Timestamp counters as Composer's Time: callbacks and algorithms written for Composer
read `state.timestamp.epoch.value`, compare with '3ep' and do arithmetic, while every
counter stays an int for code that treats it as one (JSON, msgpack, formatting)."""

from __future__ import annotations

import json
import pickle

import msgpack
import ormsgpack
import pytest

from offloop.bus import Time, Timestamp, TimeUnit
from offloop.bus.duration import Count


def test_counters_read_as_composers_time_and_stay_ints():
    ts = Timestamp.counted(2, 17, 5, 544, 0)
    assert (ts.epoch.value, ts.epoch.unit, ts.batch.unit) == (2, TimeUnit.EPOCH, TimeUnit.BATCH)
    assert ts.batch == 17 and ts.batch == "17ba" and ts.batch >= Time(10, TimeUnit.BATCH) and ts.batch < "18ba"
    assert ts.epoch.to_timestring() == "2ep" and repr(ts.epoch) == "Time(2, TimeUnit.EPOCH)"
    assert repr(ts.batch + 1) == "Time(18, TimeUnit.BATCH)" and repr("3ba" + ts.batch) == "Time(20, TimeUnit.BATCH)"
    assert (ts.batch % 5).value == 2 and (ts.batch - "7ba") == 10 and ts.batch * 2 == 34
    assert ts.batch / 2 == 8.5 and f"{ts.batch:04d}" == "0017" and str(ts.sample) == "544"
    assert ts.get(TimeUnit.SAMPLE) == 544 and isinstance(ts.get(TimeUnit.SAMPLE), Count)
    assert ts.iteration == 0 and type(ts.iteration) is int  # no unit of its own
    assert {ts.batch: "x"}[17] == "x"
    assert json.loads(json.dumps({"batch": ts.batch})) == {"batch": 17}
    assert msgpack.unpackb(msgpack.packb(ts.batch)) == 17 and ormsgpack.unpackb(ormsgpack.packb(ts.batch)) == 17
    restored = pickle.loads(pickle.dumps(ts.batch))
    assert restored == 17 and type(restored) is int
    assert ts == Timestamp(2, 17, 5, 544, 0)  # the trainer's plain one: the same counters


def test_units_never_mix():
    ts = Timestamp.counted(2, 17, 5, 544, 0)
    with pytest.raises(RuntimeError, match="cannot combine 2ep with 17ba: their units differ"):
        ts.epoch < ts.batch  # noqa: B015
    with pytest.raises(RuntimeError, match="their units differ"):
        ts.batch + "1ep"
    with pytest.raises(ValueError, match="bad duration string 'soon'"):
        ts.batch == "soon"  # noqa: B015
