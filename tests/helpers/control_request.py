"""A control request sent from inside a host trainer's hook, read at that hook's step."""

from __future__ import annotations

import threading
import time

from offloop.bus import ControlClient


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
