"""What the loops need to know about a batch: its (input, target) pair, its size, its
microbatches, its device, and how the model scores it (Composer's protocol or loss_fn=).
Plain functions; none of them synchronises the GPU."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from offloop.trainer.errors import TrainerError

__all__ = [
    "pair",
    "batch_size",
    "split",
    "to_device",
    "loader_len",
    "scalar",
    "eval_forward",
    "targets",
    "eval_loss",
    "eval_results",
]


def pair(batch: Any) -> tuple[Any, Any]:
    """(input, target) of a batch trained with loss_fn=; names what it got otherwise."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    shape = (
        f"a dict with keys {sorted(batch)}"
        if isinstance(batch, Mapping)
        else (
            f"a {type(batch).__name__} of {len(batch)}"
            if isinstance(batch, (tuple, list))
            else type(batch).__name__
        )
    )
    raise TrainerError(f"with loss_fn= a batch must be an (input, target) pair; got {shape}")


def batch_size(batch: Any) -> int:
    """The first dimension of the batch's first tensor (in tuples, lists and dicts)."""
    first = batch[0] if type(batch) is tuple and batch else batch
    if type(first) is torch.Tensor and first.ndim:  # the usual batch, read at every step
        return first.shape[0]
    while isinstance(batch, (tuple, list)) and batch:  # the first element's
        batch = batch[0]
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.ndim else 1
    if isinstance(batch, Mapping) and batch:
        return batch_size(next(iter(batch.values())))
    raise TrainerError(f"cannot tell the batch size of a {type(batch).__name__} batch")


def split(batch: Any, n: int, size: int | None = None) -> list:
    """The batch as n microbatches (tensors chunked along their first dimension), or, with
    `size`, as microbatches of `size` samples (the last one smaller), as Composer's
    device_train_microbatch_size splits it."""
    if n == 1:
        return [batch]
    if isinstance(batch, torch.Tensor):
        return list(torch.chunk(batch, n) if size is None else torch.split(batch, size))
    if isinstance(batch, (tuple, list)):
        parts = [split(x, n, size) for x in batch]
        return [
            type(batch)(p[i] for p in parts) if isinstance(batch, tuple) else [p[i] for p in parts]
            for i in range(len(parts[0]))
        ]
    if isinstance(batch, Mapping):
        parts = {k: split(v, n, size) for k, v in batch.items()}
        return [{k: v[i] for k, v in parts.items()} for i in range(len(next(iter(parts.values()))))]
    raise TrainerError(f"grad_accum={n} cannot split a {type(batch).__name__} batch")


def to_device(batch: Any, device: torch.device) -> Any:
    """The batch's tensors on `device`, copied without blocking the host."""
    if device.type == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(x, device) for x in batch)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def loader_len(loader: Any) -> int | None:
    """len(loader), or None for a loader without one."""
    try:
        return len(loader)
    except TypeError:
        return None


def dataset_len(loader: Any) -> int | None:
    """The samples in a DataLoader's dataset (every rank's, under a DistributedSampler),
    or None where the loader has no sized dataset."""
    try:
        return len(loader.dataset)
    except (AttributeError, TypeError):
        return None


def scalar(value: Any) -> Any:
    """A 0-d tensor as a Python number (a sync: used only where the loop has ended)."""
    if isinstance(value, torch.Tensor) and value.ndim == 0:
        return value.item()
    return value


# Composer's protocol: `model(batch)`, `model.loss(outputs, batch)`, optionally
# `model.eval_forward(batch)` and `model.get_targets(batch)`; with loss_fn= the model
# takes a pair's input and loss_fn scores its outputs against the pair's target.


def eval_forward(model: Any, bare: Any, loss_fn: Any, batch: Any) -> Any:
    """The outputs an evaluation scores (`bare` is the model unwrapped from DDP)."""
    if loss_fn is not None:
        return model(pair(batch)[0])
    return bare.eval_forward(batch) if hasattr(bare, "eval_forward") else model(batch)


def targets(bare: Any, loss_fn: Any, batch: Any) -> Any:
    """A batch's targets; None for a Composer-protocol model's batch that is not a pair
    (its update_metric knows where they are)."""
    if loss_fn is None and hasattr(bare, "get_targets"):
        return bare.get_targets(batch)
    if loss_fn is None and not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        return None
    return pair(batch)[1]


def update_metrics(
    metrics: dict, bare: Any, loss_fn: Any, batch: Any, outputs: Any, expected: Any
) -> None:
    """Each eval metric updated with the batch: by the model's `update_metric` where it
    follows Composer's protocol (no loss_fn) and has one, else with (outputs, targets)."""
    update = getattr(bare, "update_metric", None) if loss_fn is None else None
    if update is None and expected is None and metrics:
        raise TrainerError(
            f"{type(bare).__name__} has no update_metric(batch, outputs, metric) or "
            "get_targets(batch), and its batches are not (input, target) pairs: the eval "
            "metrics cannot know the targets"
        )
    for metric in metrics.values():
        if update is not None:
            update(batch, outputs, metric)
        else:
            metric.update(outputs, expected)


def eval_loss(bare: Any, loss_fn: Any, outputs: Any, batch: Any) -> torch.Tensor:
    return bare.loss(outputs, batch) if loss_fn is None else loss_fn(outputs, pair(batch)[1])


def eval_results(bare: Any, loss_fn: Any, metrics: Mapping, batch: Any, outputs: Any,
                 with_outputs: bool) -> tuple[torch.Tensor, int, dict[str, Any]]:
    """After an eval batch's forward: `metrics` updated; its summed loss, its size, and
    what its eval_batch_end carries beyond the label (the mean loss; with `with_outputs`
    the outputs, targets and, for an (input, target) pair, the inputs)."""
    expected = targets(bare, loss_fn, batch)
    update_metrics(metrics, bare, loss_fn, batch, outputs, expected)
    size = batch_size(batch)
    loss = eval_loss(bare, loss_fn, outputs, batch).detach() * size
    data: dict[str, Any] = {"loss": loss / size}
    if with_outputs:
        data["outputs"] = outputs.detach()
        data["targets"] = expected.detach() if expected is not None else None
        inputs = pair(batch)[0] if isinstance(batch, (tuple, list)) and len(batch) == 2 else None
        if isinstance(inputs, torch.Tensor):
            data["inputs"] = inputs.detach()
    return loss, size, data
