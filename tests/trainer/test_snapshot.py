"""The Emitter over a real publisher and subscriber: nested tensors travel, and a value
the wire cannot carry is counted, never raised into the training loop."""

from __future__ import annotations

import torch

from offloop.bus import Publisher, Subscriber
from offloop.trainer.snapshot import open_emitter


def test_tensors_nested_in_lists_travel_and_unencodable_snapshots_are_counted():
    publisher = Publisher("snap", heartbeat_interval=0.1)
    publisher.start()
    try:
        with Subscriber(publisher.endpoints["events"], publisher.endpoints["state"],
                        topics=["eval_end"]) as sub:
            sub.connect()
            emitter = open_emitter(publisher, torch.device("cpu"), burst_interval=5.0)
            # a curve metric (torchmetrics' ROC returns a tuple of tensors) and a 0-d tensor
            emitter.emit_tensors("eval_end", (1, 8, 0, 64, 0), {"metrics": {
                "roc": (torch.tensor([0.0, 0.5, 1.0]), torch.tensor([0.0, 0.8, 1.0])),
                "acc": torch.tensor(0.75)}})
            emitter.emit_tensors("eval_end", (1, 8, 0, 64, 0), {"metrics": {"odd": object()}})
            emitter.emit("eval_end", (1, 8, 0, 64, 0), {"metrics": {"also_odd": {1, 2}}})
            emitter.emit_tensors("eval_end", (2, 16, 0, 128, 0), {"metrics": {"acc": torch.tensor(0.8)}})
            assert sub.recv(timeout=0.5) is None  # held: sent at release(), or after 5 s
            emitter.release()
            got = [sub.recv(timeout=5) for _ in range(2)]
        assert emitter.unencodable == 2
        first, second = (msg.data["metrics"] for msg in got)
        fpr, tpr = first["roc"]
        assert torch.equal(fpr.to_torch(), torch.tensor([0.0, 0.5, 1.0]))
        assert torch.equal(tpr.to_torch(), torch.tensor([0.0, 0.8, 1.0]))
        assert sub.stats.gaps == 2  # the two unencodable events consumed sequence numbers: counted
        assert first["acc"] == 0.75 and second["acc"] == torch.tensor(0.8).item()
        assert [msg.ts[0] for msg in got] == [1, 2]
    finally:
        publisher.close(linger=0.1)
