"""`CallbackRuntime`: subscribe to a run, feed each event to callbacks in order, close.
It runs on the main thread of a worker process (the trainer's side of that process is
`trainer/supervisor.py`'s `_WorkerProcess`), or of `offloop worker`.

Promise: callbacks run sequentially in the order given (as pytorch-accelerated's
CallbackHandler does); one callback's exception is logged with the event and the
traceback and (by default) disables that callback only; the worker joins a run
already under way from its late-join state; on `fit_end`, or when the trainer falls
silent, it runs close()/post_close() and exits with a clear message. A worker given
`give_up_after` waits a silence out (a network partition), says so, and on heal folds
the state it missed into its State.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from offloop.bus import (
    AWAITS,
    ControlClient,
    Event,
    PublisherSilent,
    RunInfo,
    Subscriber,
    find_run,
)
from offloop.bus.security import ClientKeys, client_keys_for, endpoint_keys
from offloop.bus.subscriber import SubscriberStats
from offloop.workers import callback_state
from offloop.workers.callback import Callback, StopTrainingError
from offloop.workers.destinations import ConsoleLogger, LoggerDestination
from offloop.workers.logger import Logger
from offloop.workers.state import FrozenDict, State
from offloop.workers.state_writer import StateWriter

__all__ = ["CallbackRuntime", "Worker", "WorkerStats", "serve_trainer_callbacks",
           "StopTrainingError"]

#: checkpoints taken whose callbacks' states a worker holds until the file is durable (one
#: is written at a time; a refused one is never answered by checkpoint_saved)
_KEEP_TAKEN_STATES = 4


@dataclass
class WorkerStats:
    events: int = 0
    gaps: int = 0
    errors: int = 0
    logger_drops: int = 0  # log_* calls dropped: too many waited for the destinations
    seconds: dict[str, dict[str, float]] = field(default_factory=lambda: defaultdict(dict))

    def as_dict(self) -> dict[str, Any]:
        return {"events": self.events, "gaps": self.gaps, "errors": self.errors,
                "logger_drops": self.logger_drops, "seconds": {k: dict(v) for k, v in self.seconds.items()}}


class CallbackRuntime:
    """Runs callbacks against one run; `run()` returns an exit code. `state` is what the
    callbacks read; `writer` (a StateWriter) is the one thing that writes it."""

    def __init__(
        self,
        run: RunInfo | str,
        callbacks: list,
        *,
        runs_root: str | None = None,
        destinations: list[LoggerDestination] | None = None,
        disable_on_error: bool = True,
        exit_on_fit_end: bool = True,
        heartbeat_timeout: float = 10.0,
        give_up_after: float | None = None,
        join_timeout: float = 10.0,
        name: str | None = None,
        keys: str | ClientKeys | None = None,
        key_name: str = "client",
        index: int | None = None,
    ) -> None:
        if isinstance(keys, ClientKeys):  # a pair given as it is (the trainer's own workers')
            self.info = run if isinstance(run, RunInfo) else find_run(run, runs_root, curve=keys)
            self.curve = keys if self.info.curve_public else None
        else:  # a keys folder, and which client pair in it
            self.info = run if isinstance(run, RunInfo) else find_run(
                run, runs_root, curve=endpoint_keys(run, keys, key_name))
            self.curve = client_keys_for(self.info, keys, key_name)
        self.callbacks = list(callbacks)
        self.disable_on_error = disable_on_error
        self.exit_on_fit_end = exit_on_fit_end
        self.heartbeat_timeout, self.join_timeout = heartbeat_timeout, join_timeout
        # seconds of silence waited out before the trainer counts as gone (None: the heartbeat
        # timeout, for workers beside their trainer, where a silence means it died)
        self.give_up_after = give_up_after
        # the subscriber's silences reported as begun, and as over
        self._silences_reported = self._heals_reported = 0
        self._gaps_at_silence = self._resyncs_at_silence = 0
        self.name = name or "+".join(type(c).__name__ for c in self.callbacks) or "worker"
        self.state = State()
        self.writer = StateWriter(self.state)
        # destinations on a thread of their own: a slow one never holds up an event, nor so
        # the trainer where it awaits this worker's decision
        self.logger = Logger(self.state, destinations, coalesce=True, background=True)
        self.stats = WorkerStats()
        self.disabled: set[int] = set()
        self.exit_message = ""
        #: this worker's number among its trainer's (None: a worker the trainer did not
        #: start, which it never waits for): events awaiting it are answered to on_answer
        self.index = index
        self._on_answer: Callable[[int], None] | None = None
        self._control: ControlClient | None = None
        self._sub: Subscriber | None = None
        self._closed = False
        self._gaps_by_topic: dict[str, int] = {}
        # callbacks that keep the raw wire frames of every event (the Recorder)
        self._recorders = [c for c in self.callbacks if getattr(c, "records_messages", False)]
        # callbacks whose state_dict() is kept beside each checkpoint (a worker the trainer started)
        self._stateful = index is not None and callback_state.stateful(self.callbacks)
        self._state_warned: set[str] = set()
        self._taken_states: dict[str, list] = {}  # checkpoint path -> callbacks' states when taken
        # what dispatch() needs of each callback, looked up once: (index, callback, the
        # topics it handles or None for all, its time counters)
        self._dispatch = [(index, callback, _wanted(callback), self.stats.seconds[key])
                          for index, (callback, key)
                          in enumerate(zip(self.callbacks, _timing_keys(self.callbacks), strict=True))]

    @property
    def subscriber_stats(self) -> SubscriberStats | None:
        """What the subscription counted: received, gaps, duplicates, silences, resyncs."""
        return None if self._sub is None else self._sub.stats

    def topics(self) -> frozenset[str] | None:
        wanted: set[str] = {"init", "fit_start", "fit_end", "eval_end"}  # low-rate: keep State current
        for callback in self.callbacks:
            topics = _wanted(callback)
            if topics is None:
                return None
            wanted |= topics | _decision_topics(callback)
        if self._stateful:
            wanted |= {"after_load", "checkpoint_taken", "checkpoint_saved"}
        return frozenset(wanted)

    def connect(self) -> None:
        endpoints = self.info.endpoints
        if "control" in endpoints:
            # one client (and context) for the process; each callback asks under its own
            # name, so a halt's `stopped_by` names the callback that decided, not the process
            self._control = ControlClient(endpoints["control"],
                                          client_id=f"{self.name}-{os.getpid()}", curve=self.curve)
            for callback, key in zip(self.callbacks, _timing_keys(self.callbacks), strict=True):
                # connected now: a decision's request is then one send on a live connection
                callback.attach_control(self._control.named(f"{key}-{os.getpid()}").connect())
        else:
            for callback in self.callbacks:
                callback.attach_control(None)
        self._sub = Subscriber(endpoints["events"], endpoints.get("state"), topics=self.topics(),
                               heartbeat_timeout=self.heartbeat_timeout, give_up_after=self.give_up_after,
                               curve=self.curve)
        joined = self._sub.connect(join_timeout=self.join_timeout)
        if joined is not None:
            self.writer.apply_config(joined.config)
            for callback in self._recorders:
                callback.start(self.info, joined.config)
            for entry in sorted(joined.entries, key=lambda m: m.seq):
                self.writer.fold(entry)

    def run(self, on_fit_end: Callable[[dict], None] | None = None,
            on_progress: Callable[[dict], None] | None = None,
            on_answer: Callable[[int], None] | None = None,
            on_delivered: Callable[[dict], None] | None = None, progress_every: float = 1.0) -> int:
        """Dispatch events until the run ends; returns 0, or 3 if the trainer fell silent.
        `on_progress` gets {"batch", "events", "logs"} every `progress_every` seconds (as the
        trainer that started this worker asks: supervisor.PROGRESS_EVERY); that trainer tells
        from it how far behind the worker (and its loggers: the calls they have still to make)
        is when the run ends.
        `on_answer` gets the id of each event the trainer awaits from this worker (AWAITS),
        once its callbacks have handled it. `on_delivered` gets {"fit"} once the loggers
        have made every call up to that fit's end (from the delivering thread)."""
        self._on_answer = on_answer
        if self._sub is None:
            self.connect()
        code = 0
        next_progress = time.monotonic()
        try:
            while True:
                if on_progress is not None and time.monotonic() >= next_progress:
                    on_progress({"batch": self.state.timestamp.batch, "events": self.stats.events,
                                 "logs": self.logger.queued})
                    next_progress = time.monotonic() + progress_every
                msg = self._sub.recv(timeout=1.0)
                if self._sub.stats.silences != self._heals_reported:
                    self._report_silence()
                if msg is None:
                    if self._sub.finished:
                        self.exit_message = f"run {self.info.run_name} closed its stream"
                        break
                    continue
                if msg.from_state:  # folded in, not dispatched
                    self.writer.fold(msg)
                    # a fit_end here ended before this worker (re)joined: it never arrives live
                    ended = msg.topic == "fit_end"
                else:
                    ended = self.dispatch(msg) is Event.FIT_END
                if ended and on_fit_end is not None:  # which fit of the run: a Trainer may fit() again
                    self.stats.logger_drops = self.logger.dropped
                    on_fit_end({**self.stats.as_dict(), "fit": msg.data.get("fit"), "logs": self.logger.queued})
                if ended and on_delivered is not None:
                    self.logger.after_delivered(partial(on_delivered, {"fit": msg.data.get("fit")}))
                if ended and self.exit_on_fit_end and not msg.from_state:
                    self.exit_message = f"run {self.info.run_name} reached fit_end"
                    break
        except PublisherSilent as exc:
            self.exit_message = f"trainer of run {self.info.run_name} fell silent: {exc}"
            code = 3
        except KeyboardInterrupt:
            self.exit_message = "interrupted"
            code = 130
        finally:
            self.close()
        return code

    def _report_silence(self) -> None:
        """Say that the trainer fell silent (once a silence), and, once it is heard again, its
        state taken and the backlog counted, for how long and how many events were lost."""
        sub, stats = self._sub, self._sub.stats
        if self._silences_reported < stats.silences:  # even one already over: said, then healed
            self._silences_reported = stats.silences
            self._gaps_at_silence, self._resyncs_at_silence = stats.gaps, stats.resyncs
            print(f"offloop worker: no heartbeat from {sub.events_endpoint} for {self.heartbeat_timeout:g}s: "
                  f"partitioned or trainer gone; waiting up to {sub.give_up_after:g}s",
                  file=sys.stderr, flush=True)
        if sub.silent_since is None and not sub.recovering:
            self._heals_reported = stats.silences
            if stats.resyncs > self._resyncs_at_silence:
                state = "state resynced"
            elif sub.state_endpoint is None:
                state = "no state endpoint to resync from"
            else:
                state = "state not resynced (no answer in time)"
            print(f"offloop worker: heard from {sub.events_endpoint} again after {sub.last_silence:.1f}s; "
                  f"{state}; caught up: {stats.gaps - self._gaps_at_silence} events lost meanwhile "
                  "(counted)", file=sys.stderr, flush=True)

    def dispatch(self, msg) -> Event | str:
        """Fold one message into the State and run every enabled callback on it, in order;
        then answer it, if the trainer awaits this worker's decisions on it."""
        state, writer, topic = self.state, self.writer, msg.topic
        awaited = self._awaited(msg) if AWAITS in msg.data else None
        event = writer.fold(msg) or topic
        stats, sub = self.stats, self._sub
        stats.events += 1
        if sub is not None:
            if sub.stats.gaps != stats.gaps:
                self._note_gaps()
                writer.set(gaps=stats.gaps)
            if sub.publisher_drops != state.publisher_drops:  # from the latest heartbeat
                writer.set(publisher_drops=sub.publisher_drops)
            if sub.publisher_refused != state.publisher_refused:
                writer.set(publisher_refused=FrozenDict(sub.publisher_refused))
        writer.set(events_received=stats.events)
        for callback in self._recorders:
            callback.record(msg)
        if self._stateful and topic == "after_load" and msg.data.get("path"):
            callback_state.load_states(msg.data["path"], self.index, self.callbacks)  # before after_load runs
        clock, disabled = time.perf_counter, self.disabled
        for index, callback, wanted, spent in self._dispatch:
            if wanted is not None and topic not in wanted or index in disabled:
                continue
            start = clock()
            try:
                callback.run_event(event, state, self.logger)
            except StopTrainingError as stop:
                self._stop_training(callback, str(stop) or type(callback).__name__)
            except Exception:
                self._failed(index, callback, topic)
            finally:
                spent[topic] = spent.get(topic, 0.0) + clock() - start
        if self._stateful and topic == "checkpoint_taken" and msg.data.get("path"):
            # the states of the step the checkpoint holds; at most a few files are in flight
            self._taken_states[msg.data["path"]] = callback_state.capture_states(
                self.callbacks, self._state_warned)
            while len(self._taken_states) > _KEEP_TAKEN_STATES:
                self._taken_states.pop(next(iter(self._taken_states)))
        if self._stateful and topic == "checkpoint_saved" and msg.data.get("path"):
            path = msg.data["path"]
            entries = self._taken_states.pop(path, None)
            if entries is None:  # joined after it was taken: the states now are the nearest
                entries = callback_state.capture_states(self.callbacks, self._state_warned)
            for callback in self.callbacks:  # a CheckpointSaver with a folder of its own has moved it
                path = getattr(callback, "moved_checkpoints", {}).get(path, path)
            callback_state.save_states(path, self.index, entries)
        self.logger.commit()  # this event's metrics, one call per step to each destination
        if awaited is not None:
            writer.set(decision_awaited=False)
            if self._on_answer is not None:
                self._on_answer(awaited)
        return event

    def _awaited(self, msg) -> int | None:
        """The id the trainer awaits from this worker for `msg` (taken out of its data, so
        callbacks see the event's own fields), or None."""
        awaits = msg.data.pop(AWAITS)
        if self.index is None or not isinstance(awaits, dict) or type(awaits.get("id")) is not int \
                or not isinstance(awaits.get("workers"), list) or self.index not in awaits["workers"]:
            return None
        self.writer.set(decision_awaited=True)
        return awaits["id"]

    def _note_gaps(self) -> None:
        """Tell recorders where events were lost, topic by topic."""
        now = dict(self._sub.stats.gaps_by_topic)
        for topic, total in now.items():
            lost = total - self._gaps_by_topic.get(topic, 0)
            if lost > 0:
                for callback in self._recorders:
                    callback.record_gap(topic, lost)
        self._gaps_by_topic = now
        self.stats.gaps = self._sub.stats.gaps

    def _stop_training(self, callback, reason: str) -> None:
        """A callback raised StopTrainingError: it asks for the halt (`stop_training`)."""
        try:
            callback.stop_training(self.state, reason)
        except Exception as exc:
            print(f"offloop worker: {type(callback).__name__} could not halt the run: {exc}",
                  file=sys.stderr, flush=True)

    def _failed(self, index: int, callback, topic: str) -> None:
        self.stats.errors += 1
        name = type(callback).__name__
        action = "disabled" if self.disable_on_error else "kept"
        print(f"offloop worker: callback {name} raised on event {topic} ({action}; the others go on)\n"
              f"{traceback.format_exc()}", file=sys.stderr, flush=True)
        if self.disable_on_error:
            self.disabled.add(index)

    def close(self) -> None:
        """close() on every callback, then post_close() on every callback; then flush."""
        if self._closed:
            return
        self._closed = True
        for index, callback in enumerate(self.callbacks):
            if index in self.disabled:
                continue
            try:
                callback.close(self.state, self.logger)
            except Exception:
                self._failed(index, callback, "close")
        for index, callback in enumerate(self.callbacks):
            if index in self.disabled:  # like close(): a disabled callback is not called again
                continue
            try:
                callback.post_close()
            except Exception:
                print(f"offloop worker: {type(callback).__name__}.post_close raised\n"
                      f"{traceback.format_exc()}", file=sys.stderr, flush=True)
        self.logger.close()
        self.stats.logger_drops = self.logger.dropped
        if self._sub is not None:
            self.stats.gaps = self._sub.stats.gaps
            self._sub.close()
        if self._control is not None:
            self._control.close()


#: the name this class had before the runtime and the supervisor's `_WorkerProcess` were told
#: apart; it was public (`offloop.workers.Worker`, in older docs), so it stays importable
Worker = CallbackRuntime


def _timing_keys(callbacks: list) -> list[str]:
    """Each callback's key in the time counters: its class name, numbered (`Name#2`)
    from the second callback of the same class on."""
    keys, seen = [], {}
    for callback in callbacks:
        name = type(callback).__name__
        seen[name] = seen.get(name, 0) + 1
        keys.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return keys


def _decision_topics(callback) -> frozenset[str]:
    """The events the trainer may await this callback's decisions at: received even by a
    callback that handles them in run_event() or not at all, so the answer always comes."""
    decides_on = getattr(callback, "decides_on", None)
    return frozenset(getattr(topic, "value", topic) for topic in decides_on()) if decides_on else frozenset()


def _wanted(callback) -> frozenset[str] | None:
    wanted = getattr(type(callback), "wanted_topics", None)
    return wanted() if wanted is not None else Callback.wanted_topics.__func__(type(callback))


def _exit_with_trainer(conn, grace: float, name: str) -> None:
    """The trainer sends nothing on the socket pair after start-up, so it turns readable
    only when the trainer's end closes: the trainer closed the run, or its process died.
    A worker normally ends on its own by then (fit_end, the stream's end, or its heartbeat
    timeout); one whose main thread is stuck inside a callback would outlive its trainer,
    so after `grace` seconds it exits here."""
    try:
        conn.poll(None)
    except (OSError, EOFError, ValueError):  # closed under us: the worker is ending anyway
        return
    time.sleep(grace)
    print(f"offloop worker {name}: its trainer is gone and a callback has not returned for {grace:g}s: "
          "exiting without closing the callbacks", file=sys.stderr, flush=True)
    os._exit(4)


def serve_trainer_callbacks(callbacks: list, run_dir: str, conn, keys: ClientKeys | None = None,
                            heartbeat_timeout: float = 10.0, index: int | None = None,
                            loggers: list | None = None, builtins: dict[str, dict] | None = None,
                            progress_every: float = 1.0) -> None:
    """Entry point of a worker process the Trainer started for some of its callbacks (they
    run in order, as in Composer's loop). The shared worker also builds what the Trainer's
    own arguments name (`builtins`: a CheckpointSaver and a ProgressBar after the callbacks,
    a ConsoleLogger beside the loggers); the worker with loggers logs what Composer's
    Trainer logs itself (TrainerMetrics, first) and its callbacks log there too."""
    builtins = builtins or {}
    if "ConsoleLogger" in builtins:
        loggers = [*(loggers or []), ConsoleLogger(**builtins["ConsoleLogger"])]
    if loggers:
        from offloop.workers.callbacks.trainer_metrics import TrainerMetrics

        callbacks = [TrainerMetrics(), *callbacks]
    if "CheckpointSaver" in builtins:
        from offloop.workers.callbacks.checkpoint_saver import CheckpointSaver

        callbacks = [*callbacks, CheckpointSaver(**builtins["CheckpointSaver"])]
    if "ProgressBar" in builtins:
        from offloop.workers.callbacks.progress import ProgressBar

        callbacks = [*callbacks, ProgressBar(**builtins["ProgressBar"])]
    if not loggers:  # quiet as Composer's Trainer: the callbacks' text, no metric line per step
        loggers = [ConsoleLogger(metrics=False)]
    try:
        worker = CallbackRuntime(run_dir, callbacks, exit_on_fit_end=False,
                                 heartbeat_timeout=heartbeat_timeout, keys=keys, index=index,
                                 destinations=loggers)
        worker.connect()
    except Exception as exc:
        conn.send(("error", (None, f"could not join the run: {exc}")))
        raise SystemExit(2) from None
    conn.send(("ready", None))
    grace = 2 * heartbeat_timeout + 5
    threading.Thread(target=_exit_with_trainer, args=(conn, grace, worker.name), daemon=True,
                     name="offloop-trainer-watch").start()

    telling = threading.Lock()  # the loggers' thread tells "delivered"

    def tell(kind: str, payload: dict) -> None:
        try:
            with telling:
                conn.send((kind, payload))
        except OSError:  # the trainer is gone: its silence ends this worker (heartbeat timeout)
            pass

    code = worker.run(on_fit_end=lambda stats: tell("fit_end", stats),
                      on_progress=lambda progress: tell("progress", progress), progress_every=progress_every,
                      on_answer=lambda answer: tell("answer", answer),
                      on_delivered=lambda fit: tell("delivered", fit))
    if worker.exit_message and code:
        print(f"offloop worker {worker.name}: {worker.exit_message}", file=sys.stderr, flush=True)
    conn.close()
    raise SystemExit(code)
