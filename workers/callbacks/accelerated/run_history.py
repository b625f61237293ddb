"""`RunHistory`: pytorch-accelerated's run history, folded by a callback from the events it receives.

Promise: the same events give the same history, so every callback of a run reads the same values.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RunHistory", "RUN_HISTORY_TOPICS"]

#: What the run history is built from. The worker subscribes to all of them in any case
#: (they keep its State current), so wanting them costs nothing on the wire.
RUN_HISTORY_TOPICS = frozenset({"fit_start", "batch_end", "eval_end", "fit_end"})

# at these the timestamp's epoch counts finished epochs, so the one being trained is the next
_EPOCH_OF_NEXT_BATCH = frozenset({"init", "fit_start", "epoch_start", "batch_start", "batch_end"})


class RunHistory:
    """pytorch-accelerated's RunHistory, kept from the events its callback receives.

    'train_loss_epoch' is the sample-weighted mean of the epoch's batch losses (as
    pytorch-accelerated's LossTracker computes it); 'eval_loss_epoch' is eval_end's metric
    'loss'; every other eval metric is kept under its own name. With several eval
    dataloaders, those of a label other than 'eval' are named '<label>_loss_epoch' and
    '<label>_<metric>'. `update_metric` adds to this callback's history only.
    """

    def __init__(self) -> None:
        self._metrics: dict[str, list] = {}
        self._current_epoch = 1
        self.generation = 0  # bumped by reset(): tells a new training run's values apart
        self._loss_sum = 0.0
        self._loss_count = 0
        self._loss_epoch: int | None = None

    def get_metric_names(self) -> set[str]:
        return set(self._metrics)

    def get_metric_values(self, metric_name: str) -> list:
        return list(self._metrics.get(metric_name, ()))

    get_metric = get_metric_values  # the older pytorch-accelerated name

    def get_latest_metric(self, metric_name: str) -> Any:
        values = self._metrics.get(metric_name)
        return values[-1] if values else None

    def update_metric(self, metric_name: str, metric_value: Any) -> None:
        self._metrics.setdefault(metric_name, []).append(metric_value)

    @property
    def current_epoch(self) -> int:
        """1-based, as in pytorch-accelerated: the epoch being trained, or just trained and
        being evaluated."""
        return self._current_epoch

    def reset(self) -> None:
        self._metrics = {}
        self._current_epoch = 1
        self.generation += 1
        self._loss_sum, self._loss_count, self._loss_epoch = 0.0, 0, None

    # ------------------------------------------------------------ folding events in

    def observe(self, topic: str, state) -> None:
        """Fold one event in; the adapter calls it once per event, before the hook."""
        ts = state.timestamp
        if topic == "fit_start":
            self.reset()
        if self._loss_epoch is not None and ts.epoch > self._loss_epoch:
            self._close_train_epoch()
        if topic in _EPOCH_OF_NEXT_BATCH:
            self._current_epoch = ts.epoch + 1
        elif topic == "epoch_end":
            self._current_epoch = ts.epoch  # the counter has moved on; the epoch has not
        if topic == "batch_end" and state.loss is not None:
            weight = state.batch_size or 1
            self._loss_sum += _number(state.loss) * weight
            self._loss_count += weight
            self._loss_epoch = ts.epoch
        elif topic == "eval_end":
            self._fold_eval(state)

    def _close_train_epoch(self) -> None:
        self.update_metric("train_loss_epoch", self._loss_sum / max(self._loss_count, 1))
        self._loss_sum, self._loss_count, self._loss_epoch = 0.0, 0, None

    def _fold_eval(self, state) -> None:
        label = state.dataloader_label or "eval"
        labels = state.config.get("eval_dataloaders") or {}
        plain = label == "eval" or len(labels) <= 1
        for name, value in (state.eval_metrics.get(label) or {}).items():
            if name == "loss":
                key = "eval_loss_epoch" if plain else f"{label}_loss_epoch"
            else:
                key = name if plain else f"{label}_{name}"
            self.update_metric(key, value)


def _number(value: Any) -> float:
    if hasattr(value, "item"):
        return float(value.detach().float().mean().item()) if value.numel() != 1 else float(value.item())
    return float(value)
