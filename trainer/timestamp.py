"""Training time counters, named as in Composer's Timestamp."""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["Timestamp"]


@dataclass
class Timestamp:
    """Counters of completed work; `batch` counts optimizer steps over the whole run."""

    epoch: int = 0
    batch: int = 0
    batch_in_epoch: int = 0
    sample: int = 0
    sample_in_epoch: int = 0
    token: int = 0
    token_in_epoch: int = 0
    epoch_in_iteration: int = 0
    iteration: int = 0

    def as_tuple(self) -> tuple[int, int, int, int, int]:
        """The five counters every published event carries: the same tuple object while
        they do not change, so the events between two batches share it (a burst packs a
        shared ts once). Not a field: state_dict() and equality ignore it."""
        now = (self.epoch, self.batch, self.batch_in_epoch, self.sample, self.token)
        last = self._as_tuple
        if now == last:
            return last
        self._as_tuple = now
        return now

    def __post_init__(self) -> None:
        # set here, with the fields, so every instance has the same attributes (CPython
        # then reads them without a dict lookup); not a field itself
        self._as_tuple: tuple[int, int, int, int, int] | None = None

    def next_batch(self, samples: int, tokens: int) -> None:
        self.batch += 1
        self.batch_in_epoch += 1
        self.sample += samples
        self.sample_in_epoch += samples
        self.token += tokens
        self.token_in_epoch += tokens

    def next_epoch(self) -> None:
        self.epoch += 1
        self.epoch_in_iteration += 1
        self.batch_in_epoch = self.sample_in_epoch = self.token_in_epoch = 0

    def next_iteration(self) -> None:
        self.iteration += 1
        self.epoch_in_iteration = 0

    def state_dict(self) -> dict[str, int]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key, value in state.items():
            if hasattr(self, key):
                setattr(self, key, int(value))
