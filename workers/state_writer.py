"""`StateWriter`: the one way a run's messages, config and counts get into a `State`.

Promise: the callback runtime and replay write through it, between events, and nothing else
does; callbacks see the State read-only. Folding a message is a few dict operations.
"""

from __future__ import annotations

from typing import Any

from offloop.bus import GRAD_NORMS, Event, Message, Time, Timestamp
from offloop.bus.duration import DurationError
from offloop.bus.wire import TensorFrame
from offloop.workers.state import FrozenDict, State

__all__ = ["StateWriter"]


class StateWriter:
    """Writes one State: `fold(msg)` each message received, `apply_config(config)` the run's
    config (a late join, a replay's header), `set(**values)` the runtime's own counts
    (`gaps`, `events_received`, `publisher_drops`, `publisher_refused`, `decision_awaited`)."""

    def __init__(self, state: State) -> None:
        self.state = state
        # State refuses setattr (callbacks share it): its writer fills its __dict__ instead
        self._values = state.__dict__
        self._ts: tuple | None = None  # the wire counters `state.timestamp` was built from

    def set(self, **values: Any) -> None:
        """Set State attributes by name."""
        self._values.update(values)

    def apply_config(self, config: dict[str, Any]) -> None:
        """The run's published config: `state.config`, and what it names (run name, id,
        max_duration, dataloader length, world size)."""
        state, duration = self.state, config.get("max_duration")
        try:
            max_duration = Time.parse(duration) if duration else None
        except DurationError:
            max_duration = None
        self.set(config=FrozenDict(dict(config)), run_name=config.get("run_name", state.run_name),
                 run_id=config.get("run_id", state.run_id), max_duration=max_duration,
                 dataloader_len=config.get("dataloader_len"),
                 world_size=config.get("world_size", 1))

    def fold(self, msg: Message) -> Event | None:
        """Fold one message into the State; returns its Event (None for other topics)."""
        data = _plain_data(msg.data)
        event = _EVENTS.get(msg.topic)
        values = self._values
        if msg.ts != self._ts:  # a step's events share one timestamp: built once
            self._ts = msg.ts
            values["timestamp"] = Timestamp.counted(*msg.ts)
        values["event"], values["rank"], values["wall_time"] = event, msg.rank, msg.t
        values["data"] = data
        if "config" in data and isinstance(data["config"], dict):
            self.apply_config(data["config"])
        handler = _UPDATES.get(msg.topic)
        if handler is not None:
            handler(self, data)
        return event

    # ------------------------------------------------------- what each topic sets

    def _batch_end(self, data: dict) -> None:
        logged = data.get("metrics")
        if logged:  # log_metrics() in the training code: the latest value of each name
            self.set(train_metrics=FrozenDict({**self.state.train_metrics, **logged}))
        self.set(loss=data.get("loss"), lr=tuple(data.get("lr") or ()),
                 batch_size=data.get("batch_size"), memory=FrozenDict(data.get("memory") or {}),
                 samples=data.get("samples"), flops=data.get("flops"))

    def _grad_norms(self, data: dict) -> None:
        self.set(grad_norm=data.get("grad_norm"),
                 param_grad_norms=FrozenDict(data.get("param_grad_norms") or {}))

    def _eval_end(self, data: dict) -> None:
        label = data.get("dataloader_label", "eval")
        metrics = FrozenDict(dict(data.get("metrics") or {}))
        self.set(eval_metrics=FrozenDict({**self.state.eval_metrics, label: metrics}),
                 dataloader_label=label)

    def _eval_batch_end(self, data: dict) -> None:
        self.set(outputs=data.get("outputs"), targets=data.get("targets"),
                 dataloader_label=data.get("dataloader_label"))


_EVENTS = {event.value: event for event in Event}

_UPDATES = {
    "batch_end": StateWriter._batch_end,
    "after_loss": lambda w, d: w.set(loss=d.get("loss")),
    GRAD_NORMS: StateWriter._grad_norms,
    "eval_start": lambda w, d: w.set(dataloader_label=d.get("dataloader_label")),
    "eval_end": StateWriter._eval_end,
    "eval_batch_end": StateWriter._eval_batch_end,
    "checkpoint_saved": lambda w, d: w.set(last_checkpoint=d.get("path")),
    "fit_end": lambda w, d: w.set(stopped_by=d.get("stopped_by")),
}

_SCALARS = frozenset({int, float, str, bool, type(None), bytes})


def _plain_data(data: dict) -> FrozenDict:
    """An event's data as `state.data`: most events carry only numbers and strings, frozen
    as they are; anything else goes through _plain()."""
    for value in data.values():
        if type(value) not in _SCALARS:
            return _plain(data)
    return FrozenDict(data)


def _plain(value: Any) -> Any:
    """Wire values as callbacks want them: 0-d tensors as numbers, others as torch tensors;
    dicts frozen and lists as tuples, so nothing in `state` can be changed in place."""
    if isinstance(value, TensorFrame):
        if value.shape == ():
            return value.to_torch().item()
        return value.to_torch()
    if isinstance(value, dict):
        return FrozenDict({k: _plain(v) for k, v in value.items()})
    if isinstance(value, list):
        return tuple(_plain(v) for v in value)
    return value
