"""Code written for Composer runs with only the import line changed: callbacks that read
the timestamp as Composer's Time, and algorithms that do."""

from __future__ import annotations

import json

import torch.nn.functional as F
from common import loader, mlp

from offloop import Callback, Event, Trainer
from offloop.algorithms import Algorithm


class ComposerStyle(Callback):
    """As written for Composer: `.value`, comparisons with time strings, elapsed duration."""

    def __init__(self, path: str) -> None:
        self.path = path

    def epoch_end(self, state, logger) -> None:
        with open(self.path, "a") as out:
            out.write(json.dumps({"epoch": state.timestamp.epoch.value, "batch": state.timestamp.batch.value,
                                  "past_1ep": bool(state.timestamp.epoch >= "1ep"),
                                  "elapsed": state.get_elapsed_duration()}) + "\n")


class CountsEpochs(Algorithm):
    def __init__(self) -> None:
        self.seen = []

    def match(self, event, state) -> bool:
        return event == Event.EPOCH_END

    def apply(self, event, state, logger) -> None:
        self.seen.append((state.timestamp.epoch.value, state.timestamp.epoch.unit.value,
                          state.get_elapsed_duration()))


def test_a_callback_and_an_algorithm_written_for_composers_time_run_unchanged(tmp_path):
    path = tmp_path / "epochs.jsonl"
    algorithm = CountsEpochs()
    with Trainer(mlp(), loader(32, 8), "2ep", loss_fn=F.cross_entropy, callbacks=[ComposerStyle(str(path))],
                 algorithms=[algorithm], run_dir=tmp_path / "run") as trainer:
        trainer.fit()
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"epoch": 1, "batch": 4, "past_1ep": True, "elapsed": 0.5},
        {"epoch": 2, "batch": 8, "past_1ep": True, "elapsed": 1.0}]
    assert algorithm.seen == [(1, "ep", 0.5), (2, "ep", 1.0)]
