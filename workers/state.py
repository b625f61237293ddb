"""`State`: a read-only view of the run, built from the snapshots a worker receives.

Names follow Composer's State where they exist (`state.timestamp.epoch`,
`state.max_duration`, `state.run_name`, `state.loss`, `state.eval_metrics`, …), so
callbacks written for Composer read it unchanged. Assigning to it raises; its one writer
is `StateWriter` (workers/state_writer.py), which the runtime and replay hold.
"""

from __future__ import annotations

from typing import Any

from offloop.bus import ReadOnlyError, Timestamp

__all__ = ["State", "Timestamp", "ReadOnlyStateError", "FrozenDict"]


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


class State:
    """See the module docstring. Written only through a `StateWriter`, between events."""

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
            "publisher_refused": FrozenDict({}),
            # the trainer waits at this event for this worker: a request made now is
            # answered before training goes on (Callback.decides_on)
            "decision_awaited": False,
        }
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise ReadOnlyStateError(f"cannot set state.{name}: {_READ_ONLY}")

    def __delattr__(self, name: str) -> None:
        raise ReadOnlyStateError(f"cannot delete state.{name}: {_READ_ONLY}")

    def get_elapsed_duration(self) -> float | None:
        """The fraction of max_duration trained, in its unit (Composer's; None without one)."""
        duration = self.max_duration
        if duration is None or duration.value == 0:
            return None
        return self.timestamp.get(duration.unit) / duration.value

    def __repr__(self) -> str:
        return (f"State(run_name={self.run_name!r}, event={self.event}, timestamp={self.timestamp}, "
                f"loss={self.loss})")


