"""A control request sent from inside a host trainer's hook, read at that hook's step; a flood
of raw requests from as many clients."""

from __future__ import annotations

import threading
import time

import msgpack
import zmq

from offloop.bus import ControlClient
from offloop.bus.wire import encode_request


class RequestFromHook:
    """`send(run)` sends the request from a thread (its ack comes only once the loop applies
    it) and holds the loop until the run's control server has it in its inbox, so the
    trainer reads it at this step's end, deterministically; `ack()` waits for the answer."""

    def __init__(self, op: str, args: dict) -> None:
        self.op, self.args = op, args
        self.reply: dict = {}
        self.thread: threading.Thread | None = None

    def send(self, run) -> None:
        endpoint = run.publisher.run_info["endpoints"]["control"]

        def ask() -> None:
            with ControlClient(endpoint) as client:
                self.reply["ack"] = client.request(self.op, self.args, timeout=20)

        self.thread = threading.Thread(target=ask, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not run.control.inbox and time.monotonic() < deadline:
            time.sleep(0.005)
        assert run.control.inbox, "the request never reached the trainer's control server"

    def ack(self):
        assert self.thread is not None, "the request was never sent: its step never came"
        self.thread.join(timeout=20)
        assert "ack" in self.reply, "no ack within 20 s"
        return self.reply["ack"]


def flood(endpoint: str, count: int, *, window: int = 100, op: str = "halt", **fields) -> list[dict]:
    """`count` requests from as many clients (`flood-<n>`, req 1 each), `window` at a time
    on one raw DEALER: each window's answers are read before the next is sent."""
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    replies = []
    try:
        dealer.connect(endpoint)
        for start in range(0, count, window):
            sent = range(start, min(count, start + window))
            for n in sent:
                dealer.send(encode_request("ctl", client=f"flood-{n}", req=1, op=op,
                                           args={"reason": ""} if op == "halt" else {"tag": ""},
                                           t=time.time(), **fields))
            for _ in sent:
                assert dealer.poll(30_000), "the flood's answers stopped coming"
                replies.append(msgpack.unpackb(dealer.recv()))
        return replies
    finally:
        dealer.close()
        ctx.destroy(linger=0)
