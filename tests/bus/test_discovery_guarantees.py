"""run.json's guarantees at their edges: a failed write leaves the previous version whole
and no temporary file, one unreadable run hides no other, and an endpoint that answers
with something that is not a run is refused (tests that kill mutants of bus/discovery.py)."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import zmq

from offloop.bus import RunInfo, RunNotFound, find_run, list_runs, read_run_info
from offloop.bus.discovery import write_run_info
from offloop.bus.wire import encode_reply


def info(name="alpha", **kw):
    return RunInfo(run_id=f"id-{name}", run_name=name, pid=os.getpid(), started=time.time(),
                   endpoints={"events": "tcp://127.0.0.1:1"}, **kw)


def test_a_write_that_fails_half_way_leaves_the_previous_run_json_whole_and_no_temporary_file(tmp_path):
    write_run_info(tmp_path / "alpha", info())
    before = (tmp_path / "alpha" / "run.json").read_bytes()
    # json.dump writes the keys before "extra" to the temporary file, then fails on the value
    broken = info(extra={"progress": object()})
    with pytest.raises(TypeError, match="not JSON serializable"):
        write_run_info(tmp_path / "alpha", broken)
    assert (tmp_path / "alpha" / "run.json").read_bytes() == before
    assert [p.name for p in (tmp_path / "alpha").iterdir()] == ["run.json"]
    assert read_run_info(tmp_path / "alpha").run_name == "alpha"


def test_a_run_directory_is_created_with_its_missing_parents_owner_only(tmp_path):
    path = write_run_info(tmp_path / "runs" / "nightly" / "alpha", info())
    assert read_run_info(path.parent).run_name == "alpha"
    assert oct(path.parent.stat().st_mode & 0o777) == "0o700"


def test_an_unreadable_run_is_left_out_of_the_list_and_the_runs_after_it_are_listed(tmp_path):
    (tmp_path / "a-broken").mkdir()
    (tmp_path / "a-broken" / "run.json").write_text("{half a fil")
    (tmp_path / "b-no-fields").mkdir()
    (tmp_path / "b-no-fields" / "run.json").write_text(json.dumps({"run_id": "x"}))
    write_run_info(tmp_path / "c", info("c"))
    write_run_info(tmp_path / "d", info("d"))
    assert [run.run_name for run in list_runs(tmp_path)] == ["c", "d"]


class OneAnswer:
    """A real ROUTER socket standing in for a run's state endpoint: it answers the first
    request it gets with `reply`, from a thread, within a bounded wait."""

    def __init__(self, reply: bytes) -> None:
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.linger = 0
        self.port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.answered = threading.Event()
        self.thread = threading.Thread(target=self._answer, args=(reply,), daemon=True)
        self.thread.start()

    def _answer(self, reply: bytes) -> None:
        if self.router.poll(10_000):
            identity, _ = self.router.recv_multipart()
            self.router.send_multipart([identity, reply])
            self.answered.set()

    def close(self) -> None:
        self.thread.join(15)
        self.router.close()
        self.ctx.destroy(linger=0)


def test_an_endpoint_that_answers_with_something_that_is_not_a_run_is_refused_clearly():
    server = OneAnswer(b"\xc1 not msgpack")
    try:
        with pytest.raises(RunNotFound, match="answered with something that is not a run"):
            find_run(f"tcp://127.0.0.1:{server.port}", timeout=10)
        server.thread.join(15)  # it sets `answered` once its send returns: after the client has the reply
        assert server.answered.is_set()
    finally:
        server.close()


def test_a_run_bound_to_every_interface_is_reached_at_the_host_its_endpoint_was_asked_at():
    run = info(ranks=[{"events": "tcp://[::]:7001", "control": "tcp://10.1.2.3:7002"}]).to_dict()
    run["endpoints"] = {"events": "tcp://0.0.0.0:6001", "state": "tcp://*:6002",
                        "control": "tcp://10.1.2.3:6003"}
    server = OneAnswer(encode_reply("info", run=run))
    try:
        found = find_run(f"tcp://127.0.0.1:{server.port}", timeout=10)
    finally:
        server.close()
    assert found.endpoints == {"events": "tcp://127.0.0.1:6001", "state": "tcp://127.0.0.1:6002",
                               "control": "tcp://10.1.2.3:6003"}  # a named host is kept as it is
    assert found.ranks == [{"events": "tcp://127.0.0.1:7001", "control": "tcp://10.1.2.3:7002"}]
