"""What SaveBestModelCallback and EarlyStoppingCallback share: a watched run-history metric,
its options checked, each evaluation's new value taken once, compared as pytorch-accelerated does."""

from __future__ import annotations

from typing import Any


def check_watch(watch_metric: Any, greater_is_better: Any, reset_on_train: Any) -> None:
    if not isinstance(watch_metric, str) or not watch_metric:
        raise ValueError(f"watch_metric must be a run-history metric name, got {watch_metric!r}")
    for name, value in (("greater_is_better", greater_is_better), ("reset_on_train", reset_on_train)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")


def better(current: Any, best: Any, greater_is_better: bool) -> bool:
    """np.greater / np.less, as pytorch-accelerated compares."""
    return bool(current > best) if greater_is_better else bool(current < best)


class NewValues:
    """The watched metric's values, each once: with several eval dataloaders, an eval_end
    is not a new value of every metric."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._seen: tuple[int, int] | None = None  # (history generation, number of values)
        self._warned = False

    def take(self, trainer, metric: str) -> Any:
        """The metric's latest value if it is new since the last call, else None."""
        history = trainer.run_history
        values = history.get_metric_values(metric)
        if not values:
            if not self._warned and history.get_metric_names():
                self._warned = True
                trainer.print(f"{self.owner}: watch_metric {metric!r} is not in the run history; "
                              f"it has {', '.join(sorted(history.get_metric_names()))}")
            return None
        key = (history.generation, len(values))
        if self._seen == key:
            return None
        self._seen = key
        return values[-1]
