"""A worker's logger destinations are called on a thread of their own (workers/deliveries.py):
in order, never holding up the caller, bounded, and drained at close."""

from __future__ import annotations

import threading

from offloop.workers.deliveries import Deliveries


class Gate:
    """A destination that blocks until opened, then keeps every call it gets."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.calls: list[tuple[str, tuple]] = []

    def deliver(self, method: str, args: tuple) -> None:
        assert self.open.wait(timeout=30), "the test never opened the gate"
        self.calls.append((method, args))


def test_calls_are_made_in_order_without_holding_up_the_caller_and_close_makes_every_one():
    gate = Gate()
    deliveries = Deliveries(gate.deliver)
    for step in range(100):
        deliveries.put("log_metrics", ({"loss": step}, step))  # returns while the destination is stuck
    deliveries.put("flush", ())
    assert deliveries.queued == 101
    assert not deliveries.wait(timeout=0.05)
    gate.open.set()
    deliveries.close()
    assert gate.calls == [("log_metrics", ({"loss": step}, step)) for step in range(100)] + [("flush", ())]
    assert deliveries.queued == 0 and deliveries.dropped == 0


def test_past_the_bound_log_calls_are_dropped_and_counted_but_flush_and_close_are_kept(capfd):
    gate = Gate()
    deliveries = Deliveries(gate.deliver, max_queued=3)
    for step in range(6):  # the first is taken by the thread and waits at the gate
        deliveries.put("log_metrics", ({}, step))
    deliveries.put("flush", ())
    deliveries.put("close", ())
    gate.open.set()
    deliveries.close()
    made = [(method, args[-1] if args else None) for method, args in gate.calls]
    assert deliveries.dropped == len(range(6)) - len([m for m in made if m[0] == "log_metrics"]) > 0
    assert made[-2:] == [("flush", None), ("close", None)]
    steps = [step for method, step in made if method == "log_metrics"]
    assert steps == sorted(steps) and steps[0] == 0  # the oldest kept, in order
    assert capfd.readouterr().err.count("offloop logger: a log_metrics call was dropped (1 so far)") == 1


def test_a_destination_error_outside_its_own_handling_is_said_and_the_next_call_is_made(capfd):
    made = []

    def deliver(method: str, args: tuple) -> None:
        if method == "log_text":
            raise RuntimeError("boom")
        made.append(method)

    deliveries = Deliveries(deliver)
    deliveries.put("log_text", ("x",))
    deliveries.put("flush", ())
    deliveries.close()
    assert made == ["flush"]
    assert "offloop logger: delivering log_text failed" in capfd.readouterr().err
