"""`TrainerMetrics`: what Composer's Trainer logs itself, logged by the worker that holds
the run's loggers (`Trainer(loggers=[...])`), under Composer's names: the hyperparameters
at `fit_start`, `loss/train/total` and the training code's `log_metrics()` values
(`metrics/train/{name}`) at each `batch_end`, and `metrics/{label}/{name}` at each
`eval_end`. It also tells each logger the run (`init(state, logger)`) when it starts."""

from __future__ import annotations

from typing import Any

from offloop.workers.callback import Callback

__all__ = ["TrainerMetrics"]


class TrainerMetrics(Callback):
    """Added by the worker runtime before the callbacks of the worker holding the loggers."""

    def __init__(self) -> None:
        self._started = False

    def _start(self, state, logger) -> None:
        if self._started:
            return
        self._started = True
        logger.init(state)

    def init(self, state, logger) -> None:
        self._start(state, logger)

    def fit_start(self, state, logger) -> None:
        self._start(state, logger)
        hparams = state.config.get("hparams")
        if hparams:
            logger.log_hyperparameters(dict(hparams))

    def batch_end(self, state, logger) -> None:
        metrics: dict[str, Any] = {}
        if isinstance(state.loss, (int, float)) and not isinstance(state.loss, bool):
            metrics["loss/train/total"] = state.loss
        logged = state.data.get("metrics")  # this step's log_metrics() values, not older ones
        if logged:
            metrics.update({f"metrics/train/{name}": value for name, value in logged.items()})
        if metrics:
            logger.log_metrics(metrics)

    def eval_end(self, state, logger) -> None:
        label = state.dataloader_label or "eval"
        values = state.eval_metrics.get(label, {})
        metrics = {f"metrics/{label}/{name}": value for name, value in values.items()
                   if isinstance(value, (int, float)) and not isinstance(value, bool)}
        if metrics:
            logger.log_metrics(metrics)
