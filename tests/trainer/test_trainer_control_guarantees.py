"""The trainer's side of the control path at its edges (tests that kill mutants of
trainer/control.py and trainer/checkpoint.py): requests read at one batch get a file
each, each acked with its own, the totals the events carry count every request
and every save (a late joiner gets only the latest of each), and a checkpoint asked
right after a halt or a refused request is not lost with it."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_trainer_control import gated_run


def test_two_checkpoint_requests_at_one_batch_get_a_file_each_and_every_total_counts_them(tmp_path):
    trainer, acks, events = gated_run(tmp_path, 20, [("checkpoint", {"tag": "a"}, "a"),
                                                     ("checkpoint", {"tag": "b"}, "b")])
    a, b = acks["a"], acks["b"]
    assert a.ok and b.ok and a.result["step"] == b.result["step"] == 3
    assert (Path(a.result["path"]).name, Path(b.result["path"]).name) == ("ep0-ba3-a.pt", "ep0-ba3-b.pt")
    requests = [d for topic, _, d in events if topic == "control_request"]
    assert [d["count"] for d in requests] == [1, 2]
    saved = [d for topic, _, d in events if topic == "checkpoint_saved"]  # in the requests' arrival order
    assert [d["count"] for d in saved] == [1, 2]
    owner = {a.result["path"]: a.client, b.result["path"]: b.client}
    assert sorted(owner) == sorted(d["path"] for d in saved)
    assert all([client for client, _ in d["requested_by"]] == [owner[d["path"]]] for d in saved)
    assert sorted(p.name for p in Path(a.result["path"]).parent.iterdir()) == ["ep0-ba3-a.pt", "ep0-ba3-b.pt"]
    assert trainer.timestamp.batch == 24  # training went on


@pytest.mark.parametrize("first", [("halt", {"reason": "enough"}), ("checkpoint", {"filename": "../x.pt"})],
                         ids=["halt", "refused-checkpoint"])
def test_a_checkpoint_asked_after_a_halt_or_a_refused_request_at_the_same_batch_is_still_written(
        tmp_path, first):
    # `first` arrives first, the checkpoint after it; both while batch 3 loads
    trainer, acks, _ = gated_run(tmp_path, 20, [(*first, "first"), ("checkpoint", {"tag": "last"}, "last")])
    if first[0] == "halt":
        assert acks["first"].ok and acks["first"].result["step"] == 3
    else:  # refused, by the trainer or before it by the server (either way, alone)
        assert not acks["first"].ok and "must be a plain file name" in acks["first"].error
    assert acks["last"].ok and acks["last"].result["step"] == 3
    assert Path(acks["last"].result["path"]).name == "ep0-ba3-last.pt"
    assert trainer.timestamp.batch == (3 if first[0] == "halt" else 24)
