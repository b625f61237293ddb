"""Gradients in one contiguous buffer: zeroing is one fill, the global norm one op.

Why: on a model of many small tensors each torch call is a large share of a step, and
`zero_grad(set_to_none=True)` frees every gradient that backward then allocates again,
one call per parameter; the global norm is one call per parameter more. Here every
trainable parameter's `.grad` lies in one flat CPU buffer: a step zeroes it with one
`zero_()`, backward accumulates into it in place, and the norm is one op over the
buffer. For float32 and float64 that op is `torch.dot` of the buffer with itself
(a cheaper dispatch than `torch.linalg.vector_norm`, and its BLAS kernel, summing in
blocks, is no less accurate; both overflow to inf alike); half types keep
`vector_norm`, which sums them in float32. The price is a pass over every gradient
element (the fill, and backward adding into the buffer instead of handing it a fresh
tensor), so on a model of large tensors the buffer costs more than it saves:
`Trainer(contiguous_grads="auto")`, the default, adopts it only where the trainable
tensors are small on average (`GradBuffer.pays_off`). The figures behind both choices:
benchmarks/trainer_overhead.py, `ratio_bus_off_mean` and `ratio_bus_off_large_mean`.
Megatron's and DeepSpeed's contiguous gradient buffers do the same for their own reasons.

What the optimizer sees is what `zero_grad(set_to_none=True)` gives it: each `.grad`
is a tensor of its own over the buffer's storage (not a view: it keeps its own version
counter, which backward bumps when it accumulates into it), and a parameter that got
no gradient in a step has `.grad` None again before `after_train_batch` and the
optimizer step, so momentum, weight decay and Adam skip it as they would. Weights are
bit for bit those of the same loop with `zero_grad(set_to_none=True)`.

The buffer is adopted after the first backward of each fit, from the gradients that
backward made, and only where it changes nothing else: CPU, no DistributedDataParallel
(its reducer owns gradient layout), dense contiguous gradients of one floating dtype,
no sparse-gradient module, optimizers that zero with `torch.optim.Optimizer.zero_grad`
and hold exactly the trainable parameters. If a `.grad` is ever replaced during a
step, the buffer is given up and the trainer goes back to `zero_grad(set_to_none=True)`.
Cost: the gradients' memory is held through the forward pass (one copy of the
trainable parameters); `Trainer(contiguous_grads=False)` turns the buffer off, `True`
adopts it whatever the tensors' sizes.
"""

from __future__ import annotations

import logging
import math
from operator import attrgetter, eq, is_

import torch
from torch import nn

__all__ = ["GradBuffer"]

log = logging.getLogger("offloop.trainer")

_VERSION = attrgetter("_version")
_GRAD = attrgetter("grad")


class GradBuffer:
    """Every trainable parameter's `.grad` over one flat storage; see the module docstring."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype)
        storage, offset = self.flat.untyped_storage(), 0
        self.grads: list[torch.Tensor] = []
        for p in params:
            # set_() rather than a view: each gradient keeps a version counter of its own
            self.grads.append(
                torch.empty(0, dtype=p.dtype).set_(storage, offset, p.shape, p.stride())
            )
            offset += p.numel()
        self._versions = list(map(_VERSION, self.grads))
        self._none: list[tuple[nn.Parameter, torch.Tensor]] = []  # .grad set to None last step
        self._dot = self.flat.dtype in (torch.float32, torch.float64)  # see the module docstring

    #: "auto" adopts the buffer up to this mean number of elements per trainable tensor:
    #: below it, the calls saved outweigh the extra pass over the elements
    SMALL_TENSORS = 2048

    @classmethod
    def pays_off(cls, params: list[nn.Parameter]) -> bool:
        """Whether the buffer saves a step more than it costs (the rule behind "auto")."""
        trainable = [p for p in params if p.requires_grad]
        return bool(trainable) and sum(p.numel() for p in trainable) <= cls.SMALL_TENSORS * len(
            trainable
        )

    @classmethod
    def adopt(
        cls, model: nn.Module, params: list[nn.Parameter], optimizers: list[torch.optim.Optimizer]
    ) -> GradBuffer | None:
        """After a fit's first backward (gradients made by `zero_grad(set_to_none=True)`
        and backward): a buffer holding those gradients from now on, or None where one
        would change what the optimizer or the model sees."""
        trainable = [p for p in params if p.requires_grad]
        if not trainable or isinstance(model, nn.parallel.DistributedDataParallel):
            return None
        dtype = trainable[0].dtype
        if (
            any(
                p.device.type != "cpu"
                or p.dtype != dtype
                or p.layout != torch.strided
                or not p.is_contiguous()
                for p in trainable
            )
            or not dtype.is_floating_point
        ):
            return None
        for p in trainable:
            g = p.grad
            if g is not None and (
                g.layout != torch.strided
                or g.dtype != dtype
                or g.shape != p.shape
                or not g.is_contiguous()
            ):
                return None
        if any(getattr(m, "sparse", False) is True for m in model.modules()):
            return None  # nn.Embedding(sparse=True): its gradients must stay sparse
        optimized = {
            id(p)
            for opt in optimizers
            for group in opt.param_groups
            for p in group["params"]
            if p.requires_grad
        }
        if optimized != {id(p) for p in trainable} or any(
            type(opt).zero_grad is not torch.optim.Optimizer.zero_grad for opt in optimizers
        ):
            return None
        buffer = cls(trainable)
        for p, g in zip(trainable, buffer.grads, strict=True):
            if p.grad is None:
                buffer._none.append((p, g))  # no gradient this step: installed at the next zero()
            else:
                g.copy_(p.grad)
                p.grad = g
        return buffer

    def zero(self) -> None:
        """The step's zero_grad: one fill, and every `.grad` in place again."""
        self.flat.zero_()
        if self._none:
            for p, g in self._none:
                p.grad = g
            self._none.clear()
        self._versions = list(map(_VERSION, self.grads))  # in C: no comprehension frame

    def settle(self) -> bool:
        """After the step's backward: a parameter that got no gradient goes back to None.
        False if something replaced a `.grad` during the step (the buffer no longer holds
        the gradients: the caller gives it up). The usual step, every `.grad` still the
        buffer's and each accumulated into, is checked in C: a Python loop over the
        parameters was a visible share of a small model's step (docs/benchmarks.md)."""
        params, grads, versions = self.params, self.grads, self._versions
        kept = all(map(is_, map(_GRAD, params), grads))
        if not kept or any(map(eq, map(_VERSION, grads), versions)):
            for p, g, version in zip(params, grads, versions, strict=True):
                if p.grad is g and g._version == version:  # backward did not accumulate into it
                    p.grad = None
                    self._none.append((p, g))
        if not kept:
            log.warning(
                "offloop: a parameter's .grad was replaced during a step; the trainer "
                "goes back to zero_grad(set_to_none=True) for the rest of this fit"
            )
        return kept

    def norm(self) -> float:
        """The global L2 norm of this step's gradients (a parameter with none adds 0)."""
        flat = self.flat
        if self._dot:
            return math.sqrt(torch.dot(flat, flat).item())
        return torch.linalg.vector_norm(flat).item()
