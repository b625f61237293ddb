"""Control channel: Lazy Pirate retries, exactly-once application, stored acks."""

from __future__ import annotations

import time

import pytest
import zmq

from offloop.bus import ControlClient, ControlServer, ControlTimeout
from offloop.bus.wire import encode_request


def test_lost_first_attempt_is_applied_exactly_once_and_a_duplicate_gets_the_same_ack(
        spawn, free_port, tmp_path):
    # The server binds only once the client's first attempt is lost with its socket (the
    # client has moved on to a second), then lets retries queue behind the request before
    # it polls at all (control_server.py waits for its own duplicate count).
    from concurrent.futures import ThreadPoolExecutor

    server = spawn("control_server", free_port, tmp_path)
    client = ControlClient(f"tcp://127.0.0.1:{free_port}", client_id="client-a")
    with ThreadPoolExecutor(1) as pool:
        asked = pool.submit(client.request, "checkpoint", {"tag": "best"}, timeout=30, retry=0.2)
        deadline = time.monotonic() + 30
        while client.attempts < 2 and not asked.done() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert client.attempts >= 2, "the client never retried"
        (tmp_path / "bind").touch()
        assert "bound" in server.line()
        ack = asked.result(timeout=40)
    assert ack.ok and ack.result == {"step": 42, "path": "/ckpt/1.pt"}
    again = ControlClient(f"tcp://127.0.0.1:{free_port}", client_id="client-a")
    duplicate = again.request("checkpoint", {"tag": "best"}, timeout=5, req=ack.req)
    assert duplicate == ack
    (tmp_path / "stop").touch()
    report = server.line(timeout=15)
    assert report["applied"] == [["client-a", ack.req, "checkpoint"]]
    assert report["duplicates"] >= 2  # the queued retries and the explicit duplicate
    client.close()
    again.close()


@pytest.fixture
def server():
    srv = ControlServer()
    srv.start()
    yield srv
    srv.close()


def serve_in_background(srv, handle, stop_after=5.0):
    import threading

    def loop():
        deadline = time.monotonic() + stop_after
        while time.monotonic() < deadline:
            for request in srv.poll():
                handle(request)
            time.sleep(0.005)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


def test_poll_is_empty_and_non_blocking_when_nothing_is_pending(server):
    assert server.poll() == []


def test_refusal_reaches_the_client(server):
    serve_in_background(server, lambda r: r.refuse("run already finished"))
    with ControlClient(server.endpoint) as client:
        ack = client.halt("enough", timeout=5)
    assert not ack.ok and ack.error == "run already finished" and ack.op == "halt"


def test_unknown_op_is_refused_without_reaching_the_trainer(server):
    with ControlClient(server.endpoint) as client:
        ack = client.request("delete_everything", timeout=5)
    assert not ack.ok and "valid ops are halt, checkpoint" in ack.error
    assert server.poll() == [] and server.stats.refused == 1


def test_unauthorised_requests_are_refused_and_counted():
    srv = ControlServer(authorize=lambda r: None if r.client == "ok" else "client not authorised")
    srv.start()
    try:
        serve_in_background(srv, lambda r: r.ack(step=1))
        assert ControlClient(srv.endpoint, client_id="ok").halt(timeout=5).ok
        ack = ControlClient(srv.endpoint, client_id="mallory").halt(timeout=5)
        assert not ack.ok and ack.error == "client not authorised"
        assert srv.stats.unauthorized == 1
    finally:
        srv.close()


def test_no_answer_times_out_clearly(free_port):
    client = ControlClient(f"tcp://127.0.0.1:{free_port}")
    with pytest.raises(ControlTimeout, match=r"no acknowledgement for halt .* within 0.5s"):
        client.halt(timeout=0.5, retry=0.1)
    client.close()


def test_malformed_and_oversized_requests_are_counted_and_the_server_goes_on(server):
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.DEALER)
    rogue.linger = 0
    rogue.connect(server.endpoint)
    for raw in (b"", b"\xc1garbage", encode_request("info_req"), b"x" * (5 << 20)):
        rogue.send(raw)
    deadline = time.monotonic() + 5
    while server.stats.malformed < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.stats.malformed == 3  # the oversized one never reached the decoder
    serve_in_background(server, lambda r: r.ack(step=7))
    with ControlClient(server.endpoint) as client:
        assert client.halt(timeout=5).result == {"step": 7}
    rogue.close()
    ctx.term()


def _send(server, body: bytes) -> dict:
    """One raw request from a DEALER, and the server's reply."""
    import msgpack

    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    try:
        dealer.connect(server.endpoint)
        dealer.send(body)
        assert dealer.poll(5000), "the control server did not answer"
        return msgpack.unpackb(dealer.recv())
    finally:
        dealer.close()
        ctx.term()


@pytest.mark.parametrize("fields,named", [
    ({"op": "halt", "args": {"reason": 5}, "t": 1.0}, "halt args field 'reason' is 5, expected str"),
    ({"op": "halt", "args": {}, "t": 1.0}, "halt args field 'reason' is missing"),
    ({"op": "checkpoint", "args": {"reason": "x"}, "t": 1.0}, "checkpoint args field 'tag' is missing"),
    ({"op": "checkpoint", "args": {"tag": "x", "filename": 7}, "t": 1.0}, "'filename' is 7"),
    ({"op": "halt", "args": {"reason": "r"}}, "field 't' is missing, expected float"),
    ({"op": "fly", "args": {}, "t": 1}, "field 't' is 1, expected float"),
])
def test_a_request_breaking_the_documented_layout_is_malformed_and_never_reaches_the_trainer(
        server, fields, named):
    reply = _send(server, encode_request("ctl", client="c", req=1, **fields))
    assert reply["k"] == "error" and named in reply["error"]
    assert server.stats.malformed == 1 and server.stats.received == 0 and server.poll() == []


def test_a_checkpoint_filename_that_is_not_plain_is_refused_at_once(server):
    with ControlClient(server.endpoint) as client:
        ack = client.request("checkpoint", {"tag": "t", "filename": "../evil.pt"}, timeout=5)
        assert not ack.ok and ack.error == ("checkpoint filename '../evil.pt' must be a plain file "
                                            "name (letters, digits, '.', '-', '_')")
        for name in (".hidden", "x" * 101, "é.pt", "a/b"):
            assert not client.request("checkpoint", {"tag": "", "filename": name}, timeout=5).ok
        assert server.poll() == [] and server.stats.refused == 5 and server.stats.malformed == 0
        serve_in_background(server, lambda r: r.ack(step=1, path=r.args["filename"]))
        ack = client.request("checkpoint", {"tag": "", "filename": "ep-1_best.pt"}, timeout=5)
        assert ack.ok and ack.result["path"] == "ep-1_best.pt"


def test_the_client_always_sends_the_args_each_op_must_carry(server):
    got = []
    serve_in_background(server, lambda r: (got.append((r.op, r.args)), r.ack(step=1)))
    with ControlClient(server.endpoint) as client:
        assert client.request("halt", timeout=5).ok
        assert client.request("checkpoint", {"filename": "x.pt"}, timeout=5).ok
        assert client.halt(timeout=5).ok and client.checkpoint(timeout=5).ok
    assert got == [("halt", {"reason": ""}), ("checkpoint", {"tag": "", "filename": "x.pt"}),
                   ("halt", {"reason": ""}), ("checkpoint", {"tag": ""})]
    assert server.stats.malformed == 0
