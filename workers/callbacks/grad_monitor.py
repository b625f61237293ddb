"""Composer's `OptimizerMonitor` and its older name `GradMonitor`: gradient L2 norms.

The trainer computes the norms on its device after the backward pass, only while a
subscriber asks for them (topic `grad_norms`, just before after_train_batch: the global
norm, and per-parameter norms when built with `per_param_grad_norms=True`); these
callbacks ask for them and log them.
"""

from __future__ import annotations

from typing import Any

from offloop.bus import GRAD_NORMS, Time
from offloop.workers.callback import Callback
from offloop.workers.callbacks._intervals import batch_or_epoch_interval

__all__ = ["OptimizerMonitor", "GradMonitor"]


class OptimizerMonitor(Callback):
    """Logs `l2_norm/grad/global` and, per parameter, `l2_norm/grad/{name}` at batch_end.

    Args:
        log_optimizer_metrics: accepted for Composer compatibility. The optimizer's own
            per-parameter metrics (`report_per_parameter_metrics`) need its state, which
            stays in the trainer, so nothing more is logged either way.
        interval: log every this many batches ('10ba', an int of batches) or epochs ('1ep').
        only_global: log only the global norm, not the per-parameter norms.
    """

    state_topics = frozenset({GRAD_NORMS})

    def __init__(self, log_optimizer_metrics: bool = True, interval: int | str | Time = 1,
                 only_global: bool = False) -> None:
        self.log_optimizer_metrics = bool(log_optimizer_metrics)
        self.only_global = bool(only_global)
        self.interval = batch_or_epoch_interval(type(self).__name__, interval)
        self._norms: tuple[int, float, dict[str, float]] | None = None  # (batch, global, per param)

    def after_train_batch(self, state, logger) -> None:
        if state.grad_norm is None:  # no parameter has a gradient
            self._norms = None
            return
        per_param = {name: float(v) for name, v in state.param_grad_norms.items()}
        self._norms = (state.timestamp.batch, float(state.grad_norm), per_param)

    def batch_end(self, state, logger) -> None:
        # after_train_batch carries the pre-step counter; batch_end the one after the step
        if self._norms is None or self._norms[0] + 1 != state.timestamp.batch:
            return
        if state.timestamp.get(self.interval.unit) % self.interval.value:
            return  # as Composer: every batch while the batch (or epoch) count is a multiple
        _, global_norm, per_param = self._norms
        logger.log_metrics(self._metrics(global_norm, per_param))

    def _metrics(self, global_norm: float, per_param: dict[str, float]) -> dict[str, Any]:
        metrics: dict[str, Any] = {}
        if not self.only_global:
            metrics.update({f"l2_norm/grad/{name}": v for name, v in per_param.items()})
        metrics["l2_norm/grad/global"] = global_norm
        return metrics


class GradMonitor(OptimizerMonitor):
    """Composer's older gradient monitor: `grad_l2_norm/step` every batch and, with
    `log_layer_grad_norms=True`, `layer_grad_l2_norm/{name}` per parameter."""

    def __init__(self, log_layer_grad_norms: bool = False) -> None:
        super().__init__(interval=1, only_global=not log_layer_grad_norms)
        self.log_layer_grad_norms = bool(log_layer_grad_norms)

    def _metrics(self, global_norm: float, per_param: dict[str, float]) -> dict[str, Any]:
        metrics: dict[str, Any] = {"grad_l2_norm/step": global_norm}
        if self.log_layer_grad_norms:
            metrics.update({f"layer_grad_l2_norm/{name}": v for name, v in per_param.items()})
        return metrics
