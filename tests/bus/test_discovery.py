"""run.json: atomic writes, and finding a run by directory, name or endpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import zmq
from helpers.fsyncs import record_fsyncs

from offloop.bus import (
    Publisher,
    RunInfo,
    RunNotFound,
    find_run,
    list_runs,
    mark_finished,
    read_run_info,
)
from offloop.bus.discovery import write_run_info
from offloop.bus.wire import encode_reply


def info(name="alpha", **kw):
    return RunInfo(run_id=f"id-{name}", run_name=name, pid=os.getpid(), started=time.time(),
                   endpoints={"events": "tcp://127.0.0.1:1", "state": "tcp://127.0.0.1:2",
                              "control": "tcp://127.0.0.1:3"}, **kw)


def test_write_is_owner_only_and_leaves_no_temporary_file(tmp_path):
    path = write_run_info(tmp_path / "alpha", info())
    assert json.loads(path.read_text())["run_name"] == "alpha"
    assert oct((tmp_path / "alpha").stat().st_mode & 0o777) == "0o700"
    assert [p.name for p in (tmp_path / "alpha").iterdir()] == ["run.json"]  # no temp left


def test_a_writer_killed_inside_the_write_leaves_run_json_whole_and_the_run_findable(spawn, tmp_path):
    child = spawn("killed_mid_write", "run_info", tmp_path / "alpha")
    first = child.line(timeout=60)["first"]
    inside = child.line(timeout=60)["inside"]  # half of the second version is on disk
    child.popen.kill()
    assert child.wait() == -9
    assert inside != first  # the half-written bytes went to a file of their own
    assert read_run_info(tmp_path / "alpha").started == 1.0  # the first version, whole
    assert [run.run_name for run in list_runs(tmp_path)] == ["crash"]  # the leftover is no run
    write_run_info(tmp_path / "alpha", info())  # and the next write replaces it as usual
    assert read_run_info(tmp_path / "alpha").run_name == "alpha"


def test_find_by_directory_and_by_name(tmp_path):
    write_run_info(tmp_path / "alpha", info())
    assert find_run(str(tmp_path / "alpha")).run_id == "id-alpha"
    assert find_run("alpha", runs_root=tmp_path).run_id == "id-alpha"


def test_unknown_run_names_the_runs_that_exist(tmp_path):
    write_run_info(tmp_path / "alpha", info())
    with pytest.raises(RunNotFound, match=r"no run 'beta'.*alpha"):
        find_run("beta", runs_root=tmp_path)


def test_corrupt_run_file_is_a_clear_error(tmp_path):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "run.json").write_text("{not json")
    with pytest.raises(RunNotFound, match="cannot be read"):
        read_run_info(tmp_path / "bad")
    (tmp_path / "bad" / "run.json").write_text('{"run_id": "x"}')
    with pytest.raises(RunNotFound, match="lacks run_name"):
        read_run_info(tmp_path / "bad")


def test_mark_finished_and_list(tmp_path):
    write_run_info(tmp_path / "alpha", info())
    write_run_info(tmp_path / "beta", info("beta"))
    mark_finished(tmp_path / "alpha")
    runs = {r.run_name: r.finished for r in list_runs(tmp_path)}
    assert runs == {"alpha": True, "beta": False}


def test_find_by_endpoint_asks_the_run_itself():
    pub = Publisher("id-live")
    endpoints = pub.start()
    pub.run_info = info("live", extra={"config": {"lr": 0.1}, "note": "in run.json only"}).to_dict()
    try:
        found = find_run(endpoints["state"])
        # a run without keys answers anyone: the config (which its state carries anyway), not the rest
        assert found.run_name == "live" and found.extra == {"config": {"lr": 0.1}}
    finally:
        pub.close(linger=0)


def test_unreachable_endpoint_is_a_clear_error(free_port):
    with pytest.raises(RunNotFound, match="no run answered"):
        find_run(f"tcp://127.0.0.1:{free_port}", timeout=0.3)


def test_a_run_bound_to_every_interface_is_reached_at_the_host_asked():
    pub = Publisher("id-wild", host="0.0.0.0")
    endpoints = pub.start()
    assert endpoints["state"].startswith("tcp://0.0.0.0:")
    port = endpoints["state"].rsplit(":", 1)[1]
    run = info("wild")
    run.endpoints = {**endpoints, "control": "tcp://0.0.0.0:5555"}
    run.ranks = [dict(run.endpoints)]
    pub.run_info = run.to_dict()
    try:
        found = find_run(f"tcp://127.0.0.1:{port}")
        assert found.endpoints["state"] == f"tcp://127.0.0.1:{port}"
        assert found.endpoints["control"] == "tcp://127.0.0.1:5555"
        assert found.ranks[0]["events"] == endpoints["events"].replace("0.0.0.0", "127.0.0.1")
    finally:
        pub.close(linger=0)


# -------------------- guarantees at their edges --------------------
# Folded from test_discovery_guarantees.py (marked `guarantee`: mutation/*.toml select them).
# run.json's guarantees at their edges: a failed write leaves the previous version whole
# and no temporary file, one unreadable run hides no other, and an endpoint that answers
# with something that is not a run is refused (tests that kill mutants of bus/discovery.py).


def test_the_run_folder_is_fsynced_after_run_json_gets_its_name(tmp_path, monkeypatch):
    synced = record_fsyncs(monkeypatch)
    write_run_info(tmp_path / "alpha", info())
    assert synced[-1] == str(tmp_path / "alpha")  # the new name itself survives a power cut
    assert synced[0].startswith(str(tmp_path / "alpha" / ".run.json.pid"))  # the bytes first


_KILLED_MID_WRITE = """
import os, sys, time
from offloop.bus import RunInfo
from offloop.bus.discovery import write_run_info

def stuck(fd):
    print("writing", flush=True)
    time.sleep(60)

os.fsync = stuck  # the bytes are in the temporary file; the rename never comes
write_run_info(sys.argv[1], RunInfo(run_id="id-killed", run_name="killed", pid=os.getpid(),
                                    started=time.time(), endpoints={}))
"""


def test_a_killed_writers_run_json_temporary_is_removed_when_the_next_run_starts_there(tmp_path):
    run_dir = tmp_path / "alpha"
    write_run_info(run_dir, info())
    writer = subprocess.Popen([sys.executable, "-c", _KILLED_MID_WRITE, str(run_dir)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "writing"
    finally:
        writer.kill()
        writer.wait(timeout=10)
    left = [p.name for p in run_dir.iterdir() if p.name != "run.json"]
    assert len(left) == 1 and left[0].startswith(f".run.json.pid{writer.pid}.")
    live = run_dir / f".run.json.pid{os.getpid()}.abc123.tmp"  # a writer still at work
    live.write_text("{")
    write_run_info(run_dir, info("beta"))
    assert sorted(p.name for p in run_dir.iterdir()) == [live.name, "run.json"]
    assert read_run_info(run_dir).run_name == "beta"


@pytest.mark.guarantee
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


@pytest.mark.guarantee
def test_a_run_directory_is_created_with_its_missing_parents_owner_only(tmp_path):
    path = write_run_info(tmp_path / "runs" / "nightly" / "alpha", info())
    assert read_run_info(path.parent).run_name == "alpha"
    assert oct(path.parent.stat().st_mode & 0o777) == "0o700"


@pytest.mark.guarantee
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


@pytest.mark.guarantee
def test_an_endpoint_that_answers_with_something_that_is_not_a_run_is_refused_clearly():
    server = OneAnswer(b"\xc1 not msgpack")
    try:
        with pytest.raises(RunNotFound, match="answered with something that is not a run"):
            find_run(f"tcp://127.0.0.1:{server.port}", timeout=10)
        server.thread.join(15)  # it sets `answered` once its send returns: after the client has the reply
        assert server.answered.is_set()
    finally:
        server.close()


@pytest.mark.guarantee
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
