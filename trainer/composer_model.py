"""`ComposerModel` and `ComposerClassifier`: Composer's model protocol, so a model written
for Composer trains here with only its import changed. The Trainer honours `forward(batch)`,
`loss(outputs, batch)`, `eval_forward(batch, outputs=None)`, `get_metrics(is_train=False)`
(the evaluation's metrics when the Trainer is given no `eval_metrics`) and
`update_metric(batch, outputs, metric)`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ComposerModel", "ComposerClassifier"]


class ComposerModel(nn.Module):
    """Subclass and write `forward(batch)` and `loss(outputs, batch)`; the rest is optional."""

    def forward(self, batch: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__}.forward(batch) is not written")

    def loss(self, outputs: Any, batch: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__}.loss(outputs, batch) is not written")

    def eval_forward(self, batch: Any, outputs: Any | None = None) -> Any:
        """The outputs an evaluation scores: `outputs` if given, else `forward(batch)`."""
        return outputs if outputs is not None else self.forward(batch)

    def get_metrics(self, is_train: bool = False) -> dict[str, Any]:
        """{name: torchmetrics Metric} for evaluation (`is_train=False`); none by default."""
        return {}

    def update_metric(self, batch: Any, outputs: Any, metric: Any) -> None:
        raise NotImplementedError(f"{type(self).__name__}.get_metrics() returns metrics: write "
                                  "update_metric(batch, outputs, metric) to update them")


class ComposerClassifier(ComposerModel):
    """Composer's: a classifier from any module, on (input, target) batches; cross-entropy
    loss by default; evaluated with MulticlassAccuracy unless `val_metrics` is given."""

    def __init__(self, module: nn.Module, num_classes: int | None = None, train_metrics: Any = None,
                 val_metrics: Any = None, loss_fn: Callable = F.cross_entropy) -> None:
        super().__init__()
        self.module, self._loss_fn = module, loss_fn
        self.num_classes = getattr(module, "num_classes", num_classes)
        if self.num_classes is None and (train_metrics is None or val_metrics is None):
            raise ValueError(
                "ComposerClassifier: give num_classes (or the module a num_classes), or both "
                "train_metrics and val_metrics"
            )
        if train_metrics is None or val_metrics is None:
            from torchmetrics.classification import MulticlassAccuracy

            train_metrics = train_metrics or MulticlassAccuracy(
                num_classes=self.num_classes, average="micro"
            )
            val_metrics = val_metrics or MulticlassAccuracy(
                num_classes=self.num_classes, average="micro"
            )
        self.train_metrics, self.val_metrics = train_metrics, val_metrics

    def forward(self, batch: Any) -> torch.Tensor:
        inputs, _ = batch
        return self.module(inputs)

    def loss(self, outputs: torch.Tensor, batch: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        _, targets = batch
        return self._loss_fn(outputs, targets, *args, **kwargs)

    def get_metrics(self, is_train: bool = False) -> dict[str, Any]:
        metrics = self.train_metrics if is_train else self.val_metrics
        if hasattr(metrics, "update") and not hasattr(metrics, "items"):
            return {type(metrics).__name__: metrics}
        return dict(metrics.items())

    def update_metric(self, batch: Any, outputs: Any, metric: Any) -> None:
        _, targets = batch
        metric.update(outputs, targets)
