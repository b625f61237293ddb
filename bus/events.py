"""The Event enum shared by the trainer and the workers: Composer's 40 events.

Names and lowercase values match `composer.core.Event`; the value is the topic a
snapshot is published under, so a worker subscribes by event value.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["Event", "Topic", "EVENT_TOPICS", "CHECKPOINT_SAVED", "CHECKPOINT_TAKEN",
           "CONTROL_REQUEST", "GRAD_NORMS", "RUN_TOPICS", "AWAITS", "DECISION_EVENTS"]


class Event(str, Enum):
    """Training-loop events, in the order Composer's docs list them."""

    INIT = "init"
    BEFORE_LOAD = "before_load"
    AFTER_LOAD = "after_load"
    FIT_START = "fit_start"
    ITERATION_START = "iteration_start"
    EPOCH_START = "epoch_start"
    BEFORE_DATALOADER = "before_dataloader"
    AFTER_DATALOADER = "after_dataloader"
    BATCH_START = "batch_start"
    BEFORE_TRAIN_BATCH = "before_train_batch"
    BEFORE_FORWARD = "before_forward"
    AFTER_FORWARD = "after_forward"
    BEFORE_LOSS = "before_loss"
    AFTER_LOSS = "after_loss"
    BEFORE_BACKWARD = "before_backward"
    AFTER_BACKWARD = "after_backward"
    AFTER_TRAIN_BATCH = "after_train_batch"
    BATCH_END = "batch_end"
    BATCH_CHECKPOINT = "batch_checkpoint"
    EPOCH_END = "epoch_end"
    EPOCH_CHECKPOINT = "epoch_checkpoint"
    ITERATION_END = "iteration_end"
    ITERATION_CHECKPOINT = "iteration_checkpoint"
    FIT_END = "fit_end"
    EVAL_BEFORE_ALL = "eval_before_all"
    EVAL_START = "eval_start"
    EVAL_BATCH_START = "eval_batch_start"
    EVAL_BEFORE_FORWARD = "eval_before_forward"
    EVAL_AFTER_FORWARD = "eval_after_forward"
    EVAL_BATCH_END = "eval_batch_end"
    EVAL_END = "eval_end"
    EVAL_AFTER_ALL = "eval_after_all"
    EVAL_STANDALONE_START = "eval_standalone_start"
    EVAL_STANDALONE_END = "eval_standalone_end"
    PREDICT_START = "predict_start"
    PREDICT_BATCH_START = "predict_batch_start"
    PREDICT_BEFORE_FORWARD = "predict_before_forward"
    PREDICT_AFTER_FORWARD = "predict_after_forward"
    PREDICT_BATCH_END = "predict_batch_end"
    PREDICT_END = "predict_end"

    def __str__(self) -> str:
        return self.value

    @property
    def is_before_event(self) -> bool:
        return self.value.startswith(("before_", "eval_before_", "predict_before_"))

    @property
    def is_after_event(self) -> bool:
        return self.value.startswith(("after_", "eval_after_", "predict_after_"))

    @property
    def is_eval(self) -> bool:
        return self.value.startswith("eval_")

    @property
    def is_predict(self) -> bool:
        return self.value.startswith("predict_")


class Topic:
    """Each Event's topic as a plain str, by the Event's name (`Topic.BATCH_END ==
    Event.BATCH_END.value`), made from Event below: what a hot loop hands `publish()`.
    On Python 3.11 reading `Event.X` goes through EnumType's `__getattr__` hook, and a
    dict lookup with a member compares where a str matches at once: a step's events cost
    measurably more that way (benchmarks/trainer_overhead.py, `ratio_bus_on_mean`)."""

    __slots__ = ()


for _event in Event:
    setattr(Topic, _event.name, _event.value)
del _event

#: Published by the trainer when a checkpoint's file is durable (not a Composer event).
CHECKPOINT_SAVED = "checkpoint_saved"

#: Published by the trainer when it has taken a checkpoint: the state of that step copied,
#: its file still being written (checkpoint_saved follows, or the request's refusal). A
#: worker keeps its callbacks' state of this moment for the file (workers/callback_state.py).
CHECKPOINT_TAKEN = "checkpoint_taken"

#: Published by the trainer for each control request it reads (op, client, args, step).
CONTROL_REQUEST = "control_request"

#: Published by the trainer just before after_train_batch, and only while a subscriber
#: names this topic: the gradients' global L2 norm (and per-parameter norms with
#: `per_param_grad_norms=True`). Not in RUN_TOPICS, so a subscriber of everything does
#: not make every step pay for a norm; callbacks that read `state.grad_norm` list it in
#: their `state_topics`, as Composer's GradMonitor is the one that pays for it there.
GRAD_NORMS = "grad_norms"

#: Every topic a trainer publishes unasked; a subscription to "everything" means these.
EVENT_TOPICS: tuple[str, ...] = tuple(e.value for e in Event)
RUN_TOPICS: tuple[str, ...] = EVENT_TOPICS + (CHECKPOINT_TAKEN, CHECKPOINT_SAVED, CONTROL_REQUEST)

#: The data key of an event at which the trainer waits for some of its workers to decide
#: (`Callback.decides_on`): {"id": n, "workers": [index, ...]}; each worker named answers
#: n once it has handled the event, its requests answered.
AWAITS = "awaits"

#: The events a decision can be awaited at, and whether it needs an interval: an event of
#: every batch is awaited only at the batches its interval names, never on every batch.
DECISION_EVENTS: dict[str, bool] = {
    Event.BATCH_CHECKPOINT.value: True,
    Event.EPOCH_END.value: False,
    Event.EPOCH_CHECKPOINT.value: False,
    Event.ITERATION_END.value: False,
    Event.ITERATION_CHECKPOINT.value: False,
    Event.EVAL_END.value: False,
    Event.EVAL_AFTER_ALL.value: False,
}
