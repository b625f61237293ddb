"""`EMA`: Composer's exponential moving average of the weights. The average is updated
after each step (or epoch), evaluations run with it, and it travels with every checkpoint.

The averaged weights live beside the model (one copy of its parameters and buffers); at
`eval_start` they are swapped in, at `eval_end` swapped back, so training always steps the
training weights. A checkpoint's model holds the training weights (resume is exact) and the
average is under its algorithms' state; `get_ema_model(model)` puts the average in place
for inference (Composer's checkpoint holds the average as its model instead)."""

from __future__ import annotations

import re
from typing import Any

import torch

from offloop.bus import Event, Time, TimeUnit
from offloop.trainer.algorithms.engine import Algorithm, time_of

__all__ = ["EMA", "compute_ema"]

_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*dur\s*$")


class EMA(Algorithm):
    """`half_life` ('1000ba', or epochs) or `smoothing` (one of the two); `ema_start`: when
    averaging begins ('0.0dur', a fraction of max_duration, or 'Nba'/'Nep');
    `update_interval`: how often it is updated (default: one of `half_life`'s unit)."""

    def __init__(self, half_life: str | None = "1000ba", smoothing: float | None = None,
                 ema_start: str = "0.0dur", update_interval: str | None = None) -> None:
        if half_life is None and smoothing is None:
            raise ValueError("EMA: give half_life or smoothing")
        if half_life is not None and smoothing is not None:
            raise ValueError("EMA: give half_life or smoothing, not both")
        units = (TimeUnit.BATCH, TimeUnit.EPOCH)
        self.half_life = (
            time_of("EMA", "half_life", half_life, units) if half_life is not None else None
        )
        if update_interval is None:
            self.update_interval = Time(
                1, self.half_life.unit if self.half_life else TimeUnit.BATCH
            )
        else:
            self.update_interval = time_of("EMA", "update_interval", update_interval, units)
        if self.update_interval.value < 1:
            raise ValueError(f"EMA: update_interval must be at least 1, got {update_interval!r}")
        if self.half_life is not None:
            if self.half_life.unit != self.update_interval.unit:
                raise ValueError("EMA: half_life and update_interval must be in the same unit")
            if self.half_life.value < 1:
                raise ValueError(f"EMA: half_life must be at least 1, got {half_life!r}")
            self.smoothing = 2 ** -(self.update_interval.value / self.half_life.value)
        else:
            if (
                isinstance(smoothing, bool)
                or not isinstance(smoothing, (int, float))
                or not 0 < smoothing < 1
            ):
                raise ValueError(f"EMA: smoothing must be in (0, 1), got {smoothing!r}")
            self.smoothing = float(smoothing)
        self.ema_start = _start(ema_start)
        self.update_event = (
            Event.BATCH_END if self.update_interval.unit is TimeUnit.BATCH else Event.EPOCH_END
        )
        self.ema_model: EMAParameters | None = None
        self.ema_weights_active = False
        self.ema_started = False

    def _should_start(self, state) -> bool:
        if isinstance(self.ema_start, float):
            elapsed = state.get_elapsed_duration()
            return elapsed is not None and elapsed >= self.ema_start
        return state.timestamp.get(self.ema_start.unit) >= self.ema_start.value

    def match(self, event: Event, state) -> bool:
        if event is Event.INIT:
            return True
        if event is self.update_event and not self.ema_started and self._should_start(state):
            self.ema_model = EMAParameters(state.model)  # averaging begins from the weights of now
            self.ema_started = True
        if not self.ema_started:
            return False
        if event is self.update_event:
            return state.timestamp.get(self.update_interval.unit) % self.update_interval.value == 0
        return event in (Event.FIT_START, Event.BATCH_START, Event.EVAL_START, Event.EVAL_END)

    def apply(self, event: Event, state, logger) -> None:
        if event is Event.INIT:
            self.ema_model = EMAParameters(state.model)
        elif event is Event.FIT_START:
            self.ema_model.move_to(state.model)  # a loaded average onto the model's device
        elif event is Event.BATCH_START:
            self._training_weights(state.model)
        elif event is self.update_event:
            compute_ema(state.model, self.ema_model, self.smoothing)
        elif event is Event.EVAL_START:
            self.ema_model.move_to(state.model)
            if not self.ema_weights_active:
                self.ema_model.swap(state.model)
                self.ema_weights_active = True
        elif event is Event.EVAL_END:
            self._training_weights(state.model)

    def _training_weights(self, model: torch.nn.Module) -> None:
        if self.ema_weights_active:
            self.ema_model.swap(model)
            self.ema_weights_active = False

    def get_ema_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """`model` with the averaged weights in place (for inference after training)."""
        if self.ema_model is None:
            raise ValueError("EMA: no average yet (the Trainer has not started)")
        if not self.ema_weights_active:
            self.ema_model.swap(model)
            self.ema_weights_active = True
        return model

    def get_training_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """`model` with the training weights back in place."""
        self._training_weights(model)
        return model

    def state_dict(self) -> dict[str, Any]:
        ema = self.ema_model
        return {
            "ema_started": self.ema_started,
            "ema_weights_active": self.ema_weights_active,
            "parameters": dict(ema.parameters) if ema is not None else {},
            "buffers": dict(ema.buffers) if ema is not None else {},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ema_started = bool(state.get("ema_started", False))
        self.ema_weights_active = bool(state.get("ema_weights_active", False))
        if state.get("parameters") or state.get("buffers"):
            if self.ema_model is None:
                self.ema_model = EMAParameters(None)
            self.ema_model.load(state.get("parameters", {}), state.get("buffers", {}))

    def __repr__(self) -> str:
        return (
            f"EMA(smoothing={self.smoothing:.6g}, update_interval='{self.update_interval}', "
            f"ema_start={self.ema_start!r})"
        )


def _start(value: Any) -> float | Time:
    """'0.5dur' as the fraction 0.5; 'Nba'/'Nep' as a Time."""
    if isinstance(value, str):
        match = _DURATION.match(value)
        if match:
            fraction = float(match.group(1))
            if not 0 <= fraction <= 1:
                raise ValueError(
                    f"EMA: ema_start {value!r}: a fraction of the duration is in [0, 1]"
                )
            return fraction
    return time_of("EMA", "ema_start", value, (TimeUnit.BATCH, TimeUnit.EPOCH))


class EMAParameters:
    """The averaged copy of a model's parameters and floating-point buffers, by name."""

    def __init__(self, model: torch.nn.Module | None) -> None:
        self.parameters: dict[str, torch.Tensor] = {}
        self.buffers: dict[str, torch.Tensor] = {}
        self._pairs: tuple | None = None
        if model is not None:
            with torch.no_grad():
                self.parameters = {name: p.detach().clone() for name, p in model.named_parameters()}
                self.buffers = {name: b.detach().clone() for name, b in model.named_buffers()}

    def load(self, parameters: dict, buffers: dict) -> None:
        self.parameters = {name: t.clone() for name, t in parameters.items()}
        self.buffers = {name: t.clone() for name, t in buffers.items()}
        self._pairs = None

    def pairs(self, model: torch.nn.Module) -> tuple[list, list]:
        """([(live, average)] of floating-point tensors, [the others]), matched by name;
        kept until the averages or the model's tensors change."""
        key = (id(model), tuple(id(t) for t in model.parameters()))
        if self._pairs is None or self._pairs[0] != key:
            matched = [
                (tensor, self.parameters[name])
                for name, tensor in model.named_parameters()
                if name in self.parameters
            ]
            matched += [
                (tensor, self.buffers[name])
                for name, tensor in model.named_buffers()
                if name in self.buffers
            ]
            floats, others = [], []
            for live, avg in matched:
                (
                    floats if avg.is_floating_point() and avg.device == live.device else others
                ).append((live, avg))
            self._pairs = (key, floats, others)
        return self._pairs[1], self._pairs[2]

    def swap(self, model: torch.nn.Module) -> None:
        """Exchange the model's weights with the average, in place."""
        floats, others = self.pairs(model)
        with torch.no_grad():
            for live, average in floats + others:
                held = live.detach().clone()
                live.copy_(average)
                average.copy_(held)

    def move_to(self, model: torch.nn.Module) -> None:
        """Onto the model's device (a checkpoint's average is loaded on the CPU)."""
        device = next(model.parameters()).device
        for store in (self.parameters, self.buffers):
            for name, tensor in store.items():
                if tensor.device != device:
                    store[name] = tensor.to(device)
                    self._pairs = None


def compute_ema(model: torch.nn.Module, ema_model: EMAParameters, smoothing: float = 0.99) -> None:
    """average = smoothing * average + (1 - smoothing) * weights, in place (Composer's):
    every parameter, and the floating-point buffers (batch norm's running statistics);
    other buffers (counters) are copied. One multi-tensor lerp for all of them."""
    with torch.no_grad():
        floats, others = ema_model.pairs(model)
        if floats:
            # lerp: average + (1 - smoothing) * (weights - average), one pass over each tensor
            torch._foreach_lerp_(
                [average for _, average in floats], [live for live, _ in floats], 1 - smoothing
            )
        for live, average in others:
            average.copy_(live)
