"""`GradientClipping`: Composer's, at `after_train_batch` — after backward (and AMP's
unscaling), before the optimizer steps."""

from __future__ import annotations

from typing import Any

import torch

from offloop.bus import Event
from offloop.trainer.algorithms.engine import Algorithm

__all__ = ["GradientClipping", "apply_gradient_clipping"]

_TYPES = ("norm", "value", "adaptive")


class GradientClipping(Algorithm):
    """`clipping_type`: 'norm' (`clip_grad_norm_` to `clipping_threshold`), 'value'
    (`clip_grad_value_`) or 'adaptive' (each gradient scaled down where its norm exceeds
    `clipping_threshold` times its parameter's norm: AGC, as Composer's)."""

    def __init__(self, clipping_type: str, clipping_threshold: float) -> None:
        if clipping_type not in _TYPES:
            raise ValueError(
                f"GradientClipping: clipping_type must be 'norm', 'value' or 'adaptive', "
                f"got {clipping_type!r}"
            )
        if (
            isinstance(clipping_threshold, bool)
            or not isinstance(clipping_threshold, (int, float))
            or not clipping_threshold > 0
        ):
            raise ValueError(
                "GradientClipping: clipping_threshold must be a number > 0, "
                f"got {clipping_threshold!r}"
            )
        self.clipping_type, self.clipping_threshold = clipping_type, float(clipping_threshold)

    def match(self, event: Event, state: Any) -> bool:
        return event is Event.AFTER_TRAIN_BATCH

    def apply(self, event: Event, state: Any, logger: Any) -> None:
        apply_gradient_clipping(state.model, self.clipping_type, self.clipping_threshold)

    def __repr__(self) -> str:
        return (f"GradientClipping(clipping_type={self.clipping_type!r}, "
                f"clipping_threshold={self.clipping_threshold})")


def apply_gradient_clipping(
    model: torch.nn.Module, clipping_type: str, clipping_threshold: float
) -> None:
    """Clip `model`'s gradients in place (Composer's functional form)."""
    parameters = [p for p in model.parameters() if p.grad is not None]
    if clipping_type == "norm":
        torch.nn.utils.clip_grad_norm_(parameters, max_norm=clipping_threshold)
    elif clipping_type == "value":
        torch.nn.utils.clip_grad_value_(parameters, clip_value=clipping_threshold)
    else:
        with torch.no_grad():
            for param in parameters:
                param.grad.mul_(
                    _agc_coefficient(param.detach(), param.grad.detach(), clipping_threshold)
                )


def _agc_coefficient(weights: torch.Tensor, grad: torch.Tensor, threshold: float) -> torch.Tensor:
    """Per output unit, as Composer's: threshold * |w| / |g|, at most 1 (1 where |g| is 0)."""
    max_norm = _unitwise_norm(weights) * threshold
    return (max_norm / _unitwise_norm(grad)).nan_to_num_(nan=1.0).clamp_(max=1.0)


def _unitwise_norm(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.ndim <= 1:  # a bias or a scalar: its whole norm
        return torch.linalg.vector_norm(tensor, ord=2)
    return torch.linalg.vector_norm(tensor, ord=2, dim=tuple(range(1, tensor.ndim)), keepdim=True)
