"""Composer's `LRMonitor`: every parameter group's learning rate, from each batch_end."""

from __future__ import annotations

from offloop.workers.callback import Callback

__all__ = ["LRMonitor"]


class LRMonitor(Callback):
    """Logs `lr-{OptimizerName}/group{i}` for every optimizer and parameter group at batch_end.

    The trainer publishes the learning rates of all groups of all optimizers, in order;
    the optimizers' names (and, when published, their group counts) come from the run
    config. If several optimizers are in use and their group counts are unknown, the
    rates are logged as `lr-{Name1+Name2}/group{i}`, numbered across all groups.
    """

    def __init__(self) -> None:
        self._keys: dict[tuple, list[str]] = {}  # (optimizers' names and group counts, rates) -> keys

    def batch_end(self, state, logger) -> None:
        lrs = state.lr
        if not lrs:
            return
        optimizers = tuple((str(o.get("name", "Optimizer")), o.get("param_groups"))
                           for o in state.config.get("optimizers") or ())
        keys = self._keys.get((optimizers, len(lrs)))
        if keys is None:
            keys = self._keys[(optimizers, len(lrs))] = _keys(optimizers, len(lrs))
        logger.log_metrics(dict(zip(keys, lrs, strict=True)))


def _keys(optimizers: tuple[tuple[str, int | None], ...], count: int) -> list[str]:
    names = [name for name, _ in optimizers] or ["Optimizer"]
    groups = [n for _, n in optimizers]
    if len(names) == 1:
        groups = [count]
    elif len(names) == count:
        groups = [1] * count
    if all(isinstance(g, int) for g in groups) and sum(groups) == count:
        return [f"lr-{name}/group{i}" for name, n in zip(names, groups, strict=True) for i in range(n)]
    joined = "+".join(names)
    return [f"lr-{joined}/group{i}" for i in range(count)]
