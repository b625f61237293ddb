"""`Callback`: Composer's callback contract, run in a worker process.

One method per event, named by the event's value, and `run_event()`, which
dispatches to them; overriding `run_event` replaces that dispatch (as in Composer).
A callback changes the run only by asking: `self.halt(reason)` and
`self.request_checkpoint(tag)` go over the control channel and return the ack; raising
`StopTrainingError` from an event method asks for the halt too (`stop_training`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from offloop.bus import RUN_TOPICS, Event

if TYPE_CHECKING:
    from offloop.bus.control import Ack
    from offloop.workers.logger import Logger
    from offloop.workers.state import State

__all__ = ["Callback", "NotAttachedError", "StopTrainingError"]


class NotAttachedError(RuntimeError):
    """halt() or request_checkpoint() outside a worker connected to a run."""


class StopTrainingError(Exception):
    """Raised by a callback to stop training (pytorch-accelerated's semantics): the runtime
    hands it to the callback's `stop_training()`, which asks for a halt."""


class Callback:
    """Base class for offloop callbacks; see the module docstring."""

    _control: Any = None  # see attach_control()
    control_timeout: float = 60.0
    #: The worker process a Trainer runs this callback in: None for the one all such
    #: callbacks share, in order (as Composer runs them in its loop); a name for a process
    #: of its own, shared with the callbacks given the same name. Set by in_own_process().
    process_group: str | None = None

    def decides_on(self) -> dict[str, Any]:
        """The events at which this callback's halt() and request_checkpoint() must take
        effect exactly, as in Composer's loop: {event name: None (every one) or an interval
        ('2ep', '100ba', a Time)}. At each such event the trainer waits for this callback's
        worker to have handled it (bounded by the Trainer's `decision_timeout`), answering
        its requests meanwhile; a request made anywhere else takes effect at the first batch
        after it arrives. Empty by default: nothing waits for a callback that decides
        nothing."""
        return {}

    def in_own_process(self, name: str | None = None) -> Callback:
        """Run this callback in a worker process of its own (a slow or heavy one that should
        not hold up the others), or in the process named `name`, shared with every callback
        given that name. Returns the callback: `callbacks=[SpeedMonitor(), Upload().in_own_process()]`."""
        if name is not None and (not isinstance(name, str) or not name):
            raise ValueError(f"in_own_process(name=...) must be a non-empty str, got {name!r}")
        self.process_group = name if name is not None else f"{type(self).__name__}@{id(self):x}"
        return self

    def state_dict(self) -> dict[str, Any]:
        """What this callback must remember across a resume (Composer's): saved, as JSON,
        beside every checkpoint the trainer writes, and given to load_state_dict() when a
        Trainer resumes from that checkpoint (workers/callback_state.py). {} by default."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what state_dict() returned, before `after_load` reaches this callback."""

    def run_event(self, event: Event, state: State, logger: Logger) -> None:
        """Called by the worker on each event; dispatches to the method named by the event
        (also for `checkpoint_saved`, the trainer's announcement of a written checkpoint)."""
        method = getattr(self, getattr(event, "value", event), None)
        if method is not None:
            method(state, logger)

    def init(self, state: State, logger: Logger) -> None:
        """Called on Event.INIT."""

    def before_load(self, state: State, logger: Logger) -> None:
        """Called on Event.BEFORE_LOAD."""

    def after_load(self, state: State, logger: Logger) -> None:
        """Called on Event.AFTER_LOAD."""

    def fit_start(self, state: State, logger: Logger) -> None:
        """Called on Event.FIT_START."""

    def iteration_start(self, state: State, logger: Logger) -> None:
        """Called on Event.ITERATION_START."""

    def epoch_start(self, state: State, logger: Logger) -> None:
        """Called on Event.EPOCH_START."""

    def before_dataloader(self, state: State, logger: Logger) -> None:
        """Called on Event.BEFORE_DATALOADER."""

    def after_dataloader(self, state: State, logger: Logger) -> None:
        """Called on Event.AFTER_DATALOADER."""

    def batch_start(self, state: State, logger: Logger) -> None:
        """Called on Event.BATCH_START."""

    def before_train_batch(self, state: State, logger: Logger) -> None:
        """Called on Event.BEFORE_TRAIN_BATCH."""

    def before_forward(self, state: State, logger: Logger) -> None:
        """Called on Event.BEFORE_FORWARD."""

    def after_forward(self, state: State, logger: Logger) -> None:
        """Called on Event.AFTER_FORWARD."""

    def before_loss(self, state: State, logger: Logger) -> None:
        """Called on Event.BEFORE_LOSS."""

    def after_loss(self, state: State, logger: Logger) -> None:
        """Called on Event.AFTER_LOSS."""

    def before_backward(self, state: State, logger: Logger) -> None:
        """Called on Event.BEFORE_BACKWARD."""

    def after_backward(self, state: State, logger: Logger) -> None:
        """Called on Event.AFTER_BACKWARD."""

    def after_train_batch(self, state: State, logger: Logger) -> None:
        """Called on Event.AFTER_TRAIN_BATCH."""

    def batch_end(self, state: State, logger: Logger) -> None:
        """Called on Event.BATCH_END."""

    def batch_checkpoint(self, state: State, logger: Logger) -> None:
        """Called on Event.BATCH_CHECKPOINT."""

    def epoch_end(self, state: State, logger: Logger) -> None:
        """Called on Event.EPOCH_END."""

    def epoch_checkpoint(self, state: State, logger: Logger) -> None:
        """Called on Event.EPOCH_CHECKPOINT."""

    def iteration_end(self, state: State, logger: Logger) -> None:
        """Called on Event.ITERATION_END."""

    def iteration_checkpoint(self, state: State, logger: Logger) -> None:
        """Called on Event.ITERATION_CHECKPOINT."""

    def fit_end(self, state: State, logger: Logger) -> None:
        """Called on Event.FIT_END."""

    def eval_before_all(self, state: State, logger: Logger) -> None:
        """Called on Event.EVAL_BEFORE_ALL."""

    def eval_start(self, state: State, logger: Logger) -> None:
        """Called on Event.EVAL_START."""

    def eval_batch_start(self, state: State, logger: Logger) -> None:
        """Called on Event.EVAL_BATCH_START."""

    def eval_before_forward(self, state: State, logger: Logger) -> None:
        """Called on Event.EVAL_BEFORE_FORWARD."""

    def eval_after_forward(self, state: State, logger: Logger) -> None:
        """Called on Event.EVAL_AFTER_FORWARD."""

    def eval_batch_end(self, state: State, logger: Logger) -> None:
        """Called on Event.EVAL_BATCH_END."""

    def eval_end(self, state: State, logger: Logger) -> None:
        """Called on Event.EVAL_END."""

    def eval_after_all(self, state: State, logger: Logger) -> None:
        """Called on Event.EVAL_AFTER_ALL."""

    def eval_standalone_start(self, state: State, logger: Logger) -> None:
        """Called on Event.EVAL_STANDALONE_START."""

    def eval_standalone_end(self, state: State, logger: Logger) -> None:
        """Called on Event.EVAL_STANDALONE_END."""

    def predict_start(self, state: State, logger: Logger) -> None:
        """Called on Event.PREDICT_START."""

    def predict_batch_start(self, state: State, logger: Logger) -> None:
        """Called on Event.PREDICT_BATCH_START."""

    def predict_before_forward(self, state: State, logger: Logger) -> None:
        """Called on Event.PREDICT_BEFORE_FORWARD."""

    def predict_after_forward(self, state: State, logger: Logger) -> None:
        """Called on Event.PREDICT_AFTER_FORWARD."""

    def predict_batch_end(self, state: State, logger: Logger) -> None:
        """Called on Event.PREDICT_BATCH_END."""

    def predict_end(self, state: State, logger: Logger) -> None:
        """Called on Event.PREDICT_END."""

    def close(self, state: State, logger: Logger) -> None:
        """Called when the worker stops (after fit_end, or when the trainer fell silent)."""

    def post_close(self) -> None:
        """Called after close() has been invoked for every callback."""

    # ------------------------------------------------------------- asking

    def attach_control(self, control: Any) -> None:
        """Called by whatever runs this callback, before its first event: the handle that
        halt() and request_checkpoint() ask through (a `ControlClient` named for this
        callback, replay's `ReplayControl`), or None where the run takes no requests."""
        self._control = control

    @property
    def control_handle(self) -> Any:
        """The handle attach_control() gave, or None: not attached, or no control endpoint."""
        return self._control

    def stop_training(self, state: State, reason: str) -> None:
        """What raising StopTrainingError(reason) from an event method does; the runtime
        calls it with the State of that event. Asks for a halt; pytorch-accelerated's
        `TrainerCallback` first calls its `on_stop_training_error` hook."""
        self.halt(reason)

    def halt(self, reason: str = "") -> Ack:
        """Ask the trainer to stop after its current batch; returns the ack (with `step`)."""
        return self._ask("halt", {"reason": reason or type(self).__name__})

    def request_checkpoint(self, tag: str = "") -> Ack:
        """Ask the trainer for a checkpoint; returns the ack (with `path` and `step`)."""
        return self._ask("checkpoint", {"tag": tag})

    def _ask(self, op: str, args: dict[str, Any], on_taken=None) -> Ack:
        """The ack of `op`; `on_taken(result)` once the trainer has taken a checkpoint (its
        state copied), before the ack says the file is durable."""
        if self._control is None:
            raise NotAttachedError(
                f"{type(self).__name__}.{'halt' if op == 'halt' else 'request_checkpoint'}() "
                "needs a worker connected to a run (offloop worker, or Trainer(callbacks=[...]))"
            )
        return self._control.request(op, args, timeout=self.control_timeout, on_taken=on_taken)

    # ------------------------------------------------------------ subscribing

    #: Events this callback does not handle but whose fields it reads through `state`
    #: (say `{"batch_end"}` for `state.loss` in an `epoch_end` method): the worker
    #: subscribes to them too. Only the run's low-rate events (init, fit_start,
    #: eval_end, fit_end) are always received.
    state_topics: frozenset[str] = frozenset()

    @classmethod
    def wanted_topics(cls) -> frozenset[str] | None:
        """The topics this callback handles; None means every one (run_event overridden)."""
        if cls.run_event is not Callback.run_event:
            return None
        return frozenset(
            name for name in RUN_TOPICS
            if getattr(cls, name, None) is not getattr(Callback, name, None)
        ) | frozenset(cls.state_topics)
