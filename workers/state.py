"""`State`: a read-only view of the run, built from the snapshots a worker receives.

Names follow Composer's State where they exist (`state.timestamp.epoch`,
`state.max_duration`, `state.run_name`, `state.loss`, `state.eval_metrics`, …), so
callbacks written for Composer read it unchanged. Assigning to it raises.
"""

from __future__ import annotations

from typing import Any

from offloop.bus import GRAD_NORMS, Event, Message, ReadOnlyError, Time, Timestamp
from offloop.bus.duration import DurationError
from offloop.bus.wire import TensorFrame

__all__ = ["State", "Timestamp", "ReadOnlyStateError"]


class ReadOnlyStateError(ReadOnlyError):
    """A callback tried to change the State (its Timestamp raises the base, ReadOnlyError)."""


_READ_ONLY = ("State is read-only: workers observe the run. To change it, ask the trainer "
              "with self.halt(reason) or self.request_checkpoint(tag) from your callback.")


class FrozenDict(dict):
    """A dict inside `state` (metrics, memory, stopped_by, …): readable, JSON- and
    msgpack-serializable like any dict, but every change raises ReadOnlyStateError,
    because the callbacks of one worker share one State."""

    def _refuse(self, *args: Any, **kwargs: Any):
        raise ReadOnlyStateError(f"cannot change a dict in state: {_READ_ONLY}")

    __setitem__ = __delitem__ = __ior__ = _refuse
    clear = pop = popitem = setdefault = update = _refuse


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


class State:
    """See the module docstring. Updated only by the worker runtime, between events."""

    def __init__(self) -> None:
        values = {
            "event": None, "timestamp": Timestamp(), "run_name": "", "run_id": "",
            "max_duration": None, "config": FrozenDict({}), "loss": None, "lr": (),
            "batch_size": None, "grad_norm": None, "param_grad_norms": FrozenDict({}),
            "memory": FrozenDict({}), "eval_metrics": FrozenDict({}), "train_metrics": FrozenDict({}),
            "dataloader_label": None, "outputs": None, "targets": None, "data": FrozenDict({}),
            "rank": 0, "wall_time": 0.0, "dataloader_len": None, "world_size": 1,
            "last_checkpoint": None, "stopped_by": None, "samples": None, "flops": None,
            "gaps": 0, "events_received": 0, "publisher_drops": None,
            # the trainer waits at this event for this worker: a request made now is
            # answered before training goes on (Callback.decides_on)
            "decision_awaited": False,
        }
        for name, value in values.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_metrics", {})
        object.__setattr__(self, "_ts", None)  # the wire counters `timestamp` was built from

    def __setattr__(self, name: str, value: Any) -> None:
        raise ReadOnlyStateError(f"cannot set state.{name}: {_READ_ONLY}")

    def __delattr__(self, name: str) -> None:
        raise ReadOnlyStateError(f"cannot delete state.{name}: {_READ_ONLY}")

    def _set(self, **values: Any) -> None:
        for name, value in values.items():
            object.__setattr__(self, name, value)

    # ------------------------------------------------------------ updates

    def _apply_config(self, config: dict[str, Any]) -> None:
        try:
            max_duration = Time.parse(config["max_duration"]) if config.get("max_duration") else None
        except DurationError:
            max_duration = None
        self._set(config=FrozenDict(dict(config)), run_name=config.get("run_name", self.run_name),
                  run_id=config.get("run_id", self.run_id), max_duration=max_duration,
                  dataloader_len=config.get("dataloader_len"),
                  world_size=config.get("world_size", 1))

    def _update(self, msg: Message) -> Event | None:
        """Fold one message into the view; returns its Event (None for other topics).
        Called for every event a worker receives: kept to a few dict operations."""
        data = _plain_data(msg.data)
        event = _EVENTS.get(msg.topic)
        values = self.__dict__
        if msg.ts != values["_ts"]:  # a step's events share one timestamp: built once
            values["_ts"] = msg.ts
            values["timestamp"] = Timestamp.counted(*msg.ts)
        values["event"], values["rank"], values["wall_time"], values["data"] = event, msg.rank, msg.t, data
        if "config" in data and isinstance(data["config"], dict):
            self._apply_config(data["config"])
        handler = _UPDATES.get(msg.topic)
        if handler is not None:
            handler(self, data)
        return event

    def _batch_end(self, data: dict) -> None:
        logged = data.get("metrics")
        if logged:  # log_metrics() in the training code: the latest value of each name
            self._set(train_metrics=FrozenDict({**self.train_metrics, **logged}))
        self._set(loss=data.get("loss"), lr=tuple(data.get("lr") or ()),
                  batch_size=data.get("batch_size"),
                  memory=FrozenDict(data.get("memory") or {}),
                  samples=data.get("samples"), flops=data.get("flops"))

    def _grad_norms(self, data: dict) -> None:
        self._set(grad_norm=data.get("grad_norm"),
                  param_grad_norms=FrozenDict(data.get("param_grad_norms") or {}))

    def _eval_end(self, data: dict) -> None:
        label = data.get("dataloader_label", "eval")
        self._metrics[label] = FrozenDict(dict(data.get("metrics") or {}))
        self._set(eval_metrics=FrozenDict(dict(self._metrics)), dataloader_label=label)

    def _eval_batch_end(self, data: dict) -> None:
        self._set(outputs=data.get("outputs"), targets=data.get("targets"),
                  dataloader_label=data.get("dataloader_label"))

    def get_elapsed_duration(self) -> float | None:
        """The fraction of max_duration trained, in its unit (Composer's; None without one)."""
        duration = self.max_duration
        if duration is None or duration.value == 0:
            return None
        return self.timestamp.get(duration.unit) / duration.value

    def __repr__(self) -> str:
        return (f"State(run_name={self.run_name!r}, event={self.event}, timestamp={self.timestamp}, "
                f"loss={self.loss})")


_EVENTS = {event.value: event for event in Event}

_UPDATES = {
    "batch_end": State._batch_end,
    "after_loss": lambda s, d: s._set(loss=d.get("loss")),
    GRAD_NORMS: State._grad_norms,
    "eval_start": lambda s, d: s._set(dataloader_label=d.get("dataloader_label")),
    "eval_end": State._eval_end,
    "eval_batch_end": State._eval_batch_end,
    "checkpoint_saved": lambda s, d: s._set(last_checkpoint=d.get("path")),
    "fit_end": lambda s, d: s._set(stopped_by=d.get("stopped_by")),
}
