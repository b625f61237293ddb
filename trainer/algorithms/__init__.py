"""Algorithms: the one extension point that runs inside the training loop, on purpose.

Callbacks observe the run from other processes; what must change the loop itself — the
gradients before the optimizer steps, the weights an evaluation sees — is an Algorithm,
with Composer's protocol: `match(event, state)` and `apply(event, state, logger)`, called
in the training process at every event, before the event is published (as Composer's
Engine runs algorithms before callbacks). Their time is the training thread's: the
trainer keeps what each spends (`Trainer.algorithm_seconds`).
"""

from offloop.trainer.algorithms.ema import EMA
from offloop.trainer.algorithms.engine import Algorithm, AlgorithmLogger, Engine, LoopState
from offloop.trainer.algorithms.gradient_clipping import GradientClipping

__all__ = ["Algorithm", "AlgorithmLogger", "EMA", "Engine", "GradientClipping", "LoopState"]
