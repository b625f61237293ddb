"""pytorch-accelerated's `ClassificationMetricsCallback` example, computed in a worker process.

torchmetrics are updated from the outputs and targets the trainer publishes with each
eval batch (`Trainer(publish_eval_outputs=True)`), computed and logged at `eval_end`,
then reset: the trainer spends nothing on them beyond publishing.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from offloop.workers.callback import Callback

__all__ = ["ClassificationMetricsCallback"]

#: metric name -> torchmetrics class taking task= (Composer/torchmetrics spelling accepted)
_METRICS = {
    "accuracy": "Accuracy",
    "precision": "Precision",
    "recall": "Recall",
    "f1": "F1Score",
    "f1score": "F1Score",
    "specificity": "Specificity",
}
_TASKS = ("binary", "multiclass", "multilabel")
_AVERAGES = ("micro", "macro", "weighted", "none")
_NEEDS_OUTPUTS = ("ClassificationMetricsCallback needs the eval outputs and targets: build the "
                  "Trainer with publish_eval_outputs=True")


class ClassificationMetricsCallback(Callback):
    """Accuracy, precision and recall (or other torchmetrics) of each evaluation, computed
    from published eval outputs (pytorch-accelerated's ClassificationMetricsCallback).

    Logged at each `eval_end` as `{label}/{name}` (e.g. `eval/accuracy`) and kept in
    `history[label]`, one dict per evaluation.

    Args:
        num_classes: the number of classes (of labels, for task='multilabel').
        task: 'multiclass', 'binary' or 'multilabel' (torchmetrics' task).
        dataloader_label: the eval dataloader to measure; None measures each of them.
        metrics: names among accuracy, precision, recall, f1, specificity; or a mapping
            of name -> torchmetrics Metric for anything else (a copy runs per dataloader).
        average: torchmetrics' average for multiclass/multilabel metrics ('micro', as in
            torchmetrics' Accuracy/Precision/Recall; 'macro', 'weighted', 'none').
    """

    def __init__(
        self,
        num_classes: int,
        task: str = "multiclass",
        dataloader_label: str | None = None,
        metrics: Sequence[str] | Mapping[str, Any] = ("accuracy", "precision", "recall"),
        *,
        average: str = "micro",
    ) -> None:
        if task not in _TASKS:
            raise ValueError(f"ClassificationMetricsCallback: task {task!r} is not one of {', '.join(_TASKS)}")
        least = 1 if task == "binary" else 2
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < least:
            raise ValueError(f"ClassificationMetricsCallback: num_classes must be an int >= {least} "
                             f"for task {task!r}, got {num_classes!r}")
        if average not in _AVERAGES:
            raise ValueError(f"ClassificationMetricsCallback: average {average!r} is not one of "
                             f"{', '.join(_AVERAGES)}")
        if dataloader_label is not None and (not isinstance(dataloader_label, str) or not dataloader_label):
            raise ValueError("ClassificationMetricsCallback: dataloader_label must be None or an eval "
                             f"dataloader's label, got {dataloader_label!r}")
        self.num_classes, self.task, self.average = num_classes, task, average
        self.dataloader_label = dataloader_label
        self.metrics = _check_metrics(metrics)
        #: label -> one {name: value} per evaluation, in order (pytorch-accelerated's run history)
        self.history: dict[str, list[dict[str, Any]]] = {}
        self._collections: dict[str, Any] = {}
        self._batches: dict[str, int] = {}

    def __getstate__(self) -> dict[str, Any]:
        """Picklable and light (the trainer sends each callback to its worker process): no
        metric state, no control connection."""
        state = {**self.__dict__, "_collections": {}}
        state.pop("_control", None)
        return state

    # ------------------------------------------------------------- events

    def fit_start(self, state, logger) -> None:
        if state.config.get("publish_eval_outputs") is False:  # a trainer that says so
            self._missing(logger)

    def eval_start(self, state, logger) -> None:
        label = state.dataloader_label or "eval"
        if self._wanted(label):
            self._collection(label).reset()
            self._batches[label] = 0

    def eval_batch_end(self, state, logger) -> None:
        label = state.dataloader_label or "eval"
        if not self._wanted(label):
            return
        if state.outputs is None or state.targets is None:
            self._missing(logger)
        preds, target = _prepare(self.task, state.outputs, state.targets)
        self._collection(label).update(preds, target)
        self._batches[label] = self._batches.get(label, 0) + 1

    def eval_end(self, state, logger) -> None:
        label = state.dataloader_label or "eval"
        if not self._wanted(label) or not self._batches.get(label):
            return
        collection = self._collection(label)
        values = {name: _plain(value) for name, value in collection.compute().items()}
        collection.reset()
        seen, self._batches[label] = self._batches[label], 0
        expected = (state.config.get("eval_dataloaders") or {}).get(label)
        if expected and seen != expected:
            logger.log_text(f"ClassificationMetricsCallback: {label} metrics cover {seen} of "
                            f"{expected} eval batches (events were lost)")
        self.history.setdefault(label, []).append(values)
        logger.log_metrics({f"{label}/{name}": value for name, value in values.items()})

    # ------------------------------------------------------------- helpers

    def _wanted(self, label: str) -> bool:
        return self.dataloader_label is None or label == self.dataloader_label

    def _missing(self, logger) -> None:
        logger.log_text(_NEEDS_OUTPUTS)
        raise ValueError(_NEEDS_OUTPUTS)

    def _collection(self, label: str):
        if label not in self._collections:
            self._collections[label] = self._build()
        return self._collections[label]

    def _build(self):
        import torchmetrics

        built = {}
        for name, spec in self.metrics.items():
            if not isinstance(spec, str):
                built[name] = copy.deepcopy(spec)
                continue
            kwargs: dict[str, Any] = {"task": self.task}
            if self.task == "multiclass":
                kwargs.update(num_classes=self.num_classes, average=self.average)
            elif self.task == "multilabel":
                kwargs.update(num_labels=self.num_classes, average=self.average)
            built[name] = getattr(torchmetrics, spec)(**kwargs)
        return torchmetrics.MetricCollection(built)


def _check_metrics(metrics: Sequence[str] | Mapping[str, Any]) -> dict[str, Any]:
    """name -> torchmetrics class name (for built-in names) or a Metric instance."""
    if isinstance(metrics, Mapping):
        for name, metric in metrics.items():
            if not (hasattr(metric, "update") and hasattr(metric, "compute") and hasattr(metric, "reset")):
                raise ValueError(f"ClassificationMetricsCallback: metrics[{name!r}] is a "
                                 f"{type(metric).__name__}, not a torchmetrics Metric")
        return dict(metrics)
    if isinstance(metrics, str) or not metrics:
        raise ValueError("ClassificationMetricsCallback: metrics must be a non-empty sequence of names "
                         f"({', '.join(_METRICS)}) or a mapping of name -> Metric, got {metrics!r}")
    chosen = {}
    for name in metrics:
        key = str(name).lower()
        if key not in _METRICS:
            raise ValueError(f"ClassificationMetricsCallback: unknown metric {name!r}; known: "
                             f"{', '.join(_METRICS)} (or pass a mapping of name -> torchmetrics Metric)")
        chosen[str(name)] = _METRICS[key]
    return chosen


def _prepare(task: str, outputs, targets):
    """Outputs and targets as torchmetrics takes them for `task`: float32 scores, integer
    targets, one score a sample for a binary task."""
    import torch

    preds = outputs.float() if outputs.is_floating_point() else outputs
    if task == "binary":
        if preds.ndim == 2 and preds.shape[1] == 2:
            preds = preds.softmax(dim=1)[:, 1]
        elif preds.ndim == 2 and preds.shape[1] == 1:
            preds = preds[:, 0]
        if targets.ndim == 2 and targets.shape[1] == 1:
            targets = targets[:, 0]
    if task == "multiclass" and targets.ndim == 2 and targets.shape == preds.shape:
        targets = targets.argmax(dim=1)  # one-hot (or soft) targets
    if targets.is_floating_point() or task == "multilabel":
        targets = targets.to(torch.long)
    return preds, targets


def _plain(value: Any) -> Any:
    """0-d tensors as Python floats; per-class results (average='none') as lists."""
    if hasattr(value, "ndim"):
        return value.item() if value.ndim == 0 else value.tolist()
    return value
