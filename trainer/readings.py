"""What a step's snapshots hold beyond the loss: gradient norms, learning rates, memory,
flops and sample tensors. Promise: nothing here synchronises the GPU (on CUDA the values
stay tensors, staged later by the Emitter)."""

from __future__ import annotations

import math
import resource
from collections.abc import Callable
from itertools import chain
from operator import attrgetter, itemgetter
from typing import Any

import torch

from offloop.trainer.batches import pair
from offloop.trainer.grads import GradBuffer
from offloop.trainer.user_metrics import UserMetrics

__all__ = ["StepReadings", "describe_optimizer"]

_LR, _PARAM_GROUPS = itemgetter("lr"), attrgetter("param_groups")  # read in C at every batch_end


class StepReadings:
    """Builds after_train_batch's and batch_end's data; `host` is the Emitter's."""

    def __init__(
        self,
        device: torch.device,
        optimizers: list,
        host: Callable[[torch.Tensor], Any],
        *,
        per_param_grad_norms: bool,
        publish_samples: int,
        flops_fn: Callable | None,
    ) -> None:
        self.device, self.optimizers, self.host = device, optimizers, host
        self._device_type = device.type  # read per batch: torch.device.type builds a new str
        self.per_param_grad_norms, self.publish_samples, self.flops_fn = (
            per_param_grad_norms,
            publish_samples,
            flops_fn,
        )
        self._names: list[str] = []
        self.params: list[torch.nn.Parameter] = []  # the model's, in named_parameters() order
        #: CUDA allocator counters or the peak resident memory, as last read (published as is)
        self._memory: dict[str, int] | None = None
        #: what training code logs with log_metrics(): taken by the next batch_end (or eval_end)
        self.user_metrics = UserMetrics(host)

    def track(self, named_parameters: list[tuple[str, torch.nn.Parameter]]) -> None:
        """The parameters whose gradients grads() reads (set at each fit's start)."""
        self._names = [name for name, _ in named_parameters]
        self.params = [param for _, param in named_parameters]

    def grad_norms(self, buffer: GradBuffer | None = None) -> dict[str, Any]:
        """What `grad_norms` publishes: the contiguous buffer's one-op global norm where
        there is a buffer and no per-parameter norms are asked for; otherwise the global
        norm from per-parameter norms, computed on the device (no sync)."""
        if buffer is not None and not self.per_param_grad_norms:
            return {"grad_norm": buffer.norm()}
        # backward never builds a graph of the gradients here: they need no detach()
        names, grads = self._names, [p.grad for p in self.params]
        if any(g is None for g in grads):
            names = [n for n, g in zip(names, grads, strict=True) if g is not None]
            grads = [g for g in grads if g is not None]
            if not grads:
                return {"grad_norm": None}
        norms = torch._foreach_norm(grads)  # one kernel launch for every parameter
        if self._device_type == "cpu":
            # host numbers now (no device to wait for): the per-parameter norms combined
            # in double precision on the host cost half what two more torch ops would
            values = [n.item() for n in norms] if len(norms) <= 16 else torch.stack(norms).tolist()
            snapshot: dict[str, Any] = {"grad_norm": _hypot(values)}
            if self.per_param_grad_norms:
                snapshot["param_grad_norms"] = dict(zip(names, values, strict=True))
            return snapshot
        snapshot = {"grad_norm": torch.linalg.vector_norm(torch.stack(norms))}
        if self.per_param_grad_norms:
            snapshot["param_grad_norms"] = dict(zip(names, norms, strict=True))
        return snapshot

    def batch_end(
        self, loss: Any, size: int, step: int, batch: Any, micro: Any, outputs: Any
    ) -> dict[str, Any]:
        """What batch_end callbacks read; `micro` and `outputs` are the step's last microbatch's."""
        snapshot: dict[str, Any] = {
            "loss": loss,
            "lr": list(map(_LR, chain.from_iterable(map(_PARAM_GROUPS, self.optimizers)))),
            "batch_size": size,
        }
        if self._memory is None or not step % 16:  # read every 16 steps (docs/trainer.md)
            # a new dict: held events keep theirs
            self._memory = (
                _cuda_memory(self.device)
                if self._device_type == "cuda"
                else {"max_rss_bytes": _max_rss()}
            )
        snapshot["memory"] = self._memory
        if self.user_metrics.values:
            snapshot["metrics"] = self.user_metrics.take()
        if self.flops_fn is not None:
            flops = self.flops_fn(batch)
            snapshot["flops"] = self.host(flops) if isinstance(flops, torch.Tensor) else flops
        if self.publish_samples:
            inputs, targets = pair(micro) if isinstance(micro, (tuple, list)) else (micro, None)
            n, host = self.publish_samples, self.host
            snapshot["samples"] = {  # tensors: frames on the wire (0-d ones become numbers)
                "inputs": host(inputs[:n]) if isinstance(inputs, torch.Tensor) else None,
                "targets": host(targets[:n]) if isinstance(targets, torch.Tensor) else None,
                "outputs": host(outputs[:n]) if isinstance(outputs, torch.Tensor) else None,
            }
        return snapshot


def describe_optimizer(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """An optimizer as the run config shows it: its name and its first group's settings."""
    group = opt.param_groups[0] if opt.param_groups else {}
    return {
        "name": type(opt).__name__,
        "param_groups": len(opt.param_groups),
        **{k: v for k, v in group.items() if isinstance(v, (int, float, str, bool))},
    }


def _cuda_memory(device: torch.device) -> dict[str, int]:
    """Allocator counters, read on the host: no device synchronisation. The nested dict is
    the allocator's own; memory_stats() and memory_allocated() flatten all of it in Python
    first, several times the cost (benchmarks/trainer_overhead.py --device cuda,
    `ratio_bus_on_mean`)."""
    stats = torch.cuda.memory_stats_as_nested_dict(device)
    allocated, reserved = (
        stats.get("allocated_bytes", {}).get("all", {}),
        stats.get("reserved_bytes", {}).get("all", {}),
    )
    return {
        "allocated_bytes": allocated.get("current", 0),
        "reserved_bytes": reserved.get("current", 0),
        "max_allocated_bytes": allocated.get("peak", 0),
    }


def _max_rss() -> int:
    """Peak resident memory of this process, in bytes (one cheap syscall)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _hypot(values: list[float]) -> float:
    """sqrt of the sum of squares, as torch.linalg.vector_norm: NaN wins over inf."""
    norm = math.hypot(*values)
    return math.nan if math.isinf(norm) and any(math.isnan(v) for v in values) else norm
