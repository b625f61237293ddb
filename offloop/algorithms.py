"""Algorithms, in the training loop on purpose: `Trainer(algorithms=[GradientClipping(...),
EMA()])`, with Composer's protocol (`match`, `apply`) and names;
`from offloop.algorithms import GradientClipping, EMA`.

The public home of `offloop.trainer.algorithms` (docs/trainer.md, Algorithms).
"""

from offloop.trainer.algorithms import EMA, Algorithm, GradientClipping
from offloop.trainer.algorithms.ema import compute_ema
from offloop.trainer.algorithms.gradient_clipping import apply_gradient_clipping

__all__ = ["Algorithm", "EMA", "GradientClipping", "apply_gradient_clipping", "compute_ema"]
