"""The worker runtime: order, isolation of failures, subscriptions, joining late, silence."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers.harness import MemoryLog, run_with_worker
from helpers.waiting import wait_for_file

from offloop.bus import ReadOnlyError
from offloop.trainer import Trainer
from offloop.workers import Callback, CallbackRuntime, ReadOnlyStateError
from offloop.workers.spec import SpecError, build_callback, parse_spec

ROOT = Path(__file__).parent.parent.parent
TESTS = ROOT / "tests"


class Tracer(Callback):
    def __init__(self, name, log):
        self.name, self.log = name, log

    def batch_end(self, state, logger):
        self.log.append((self.name, state.timestamp.batch))


class Boom(Callback):
    def __init__(self):
        self.calls = 0
        self.closed = False

    def batch_end(self, state, logger):
        self.calls += 1
        raise ValueError("boom")

    def close(self, state, logger):
        self.closed = True

    def post_close(self):
        self.closed = True


class Mutator(Callback):
    def __init__(self):
        self.error = None
        self.nested_errors: list[str] = []

    def batch_end(self, state, logger):
        try:
            state.loss = 0.0
        except ReadOnlyStateError as exc:
            self.error = str(exc)
        changes = (lambda: state.memory.__setitem__("max_rss_bytes", 0),
                   lambda: state.data.update(loss=0.0),
                   lambda: state.config.pop("run_name"),
                   lambda: setattr(state.timestamp, "batch", 0))
        for change in changes:
            try:
                change()
            except ReadOnlyError as exc:  # the State's own ReadOnlyStateError, or its Timestamp's
                self.nested_errors.append(str(exc))


def test_callbacks_run_sequentially_in_the_order_given(tmp_path):
    log: list = []
    run_with_worker([Tracer("a", log), Tracer("b", log)], tmp_path, max_duration="4ba")
    assert log == [(n, b) for b in range(1, 5) for n in ("a", "b")]


def test_a_failing_callback_is_disabled_with_event_and_traceback_and_the_others_go_on(tmp_path, capsys):
    log: list = []
    boom = Boom()
    _, worker = run_with_worker([boom, Tracer("after", log)], tmp_path, max_duration="4ba")
    err = capsys.readouterr().err
    assert "callback Boom raised on event batch_end (disabled" in err
    assert "ValueError: boom" in err and "Traceback" in err
    assert boom.calls == 1 and len(log) == 4 and worker.stats.errors == 1
    assert not boom.closed  # disabled: neither close() nor post_close() is called


def test_failing_callback_can_be_kept(tmp_path, capsys):
    boom = Boom()
    run_with_worker([boom], tmp_path, max_duration="3ba", worker_kw={"disable_on_error": False})
    assert boom.calls == 3 and boom.closed
    assert capsys.readouterr().err.count("raised on event batch_end (kept") == 3


class LateAsker(Callback):
    """Asks for a checkpoint at the first epoch's end only once the trainer's fit() has
    returned: a worker that fell that far behind on a busy machine."""

    control_timeout = 10.0

    def __init__(self, fit_returned):
        self.fit_returned, self.ack = fit_returned, None

    def epoch_end(self, state, logger):
        if self.ack is None:
            assert self.fit_returned.wait(30)
            self.ack = self.request_checkpoint("late")


def test_a_request_a_worker_sends_after_the_fit_returned_is_answered_while_it_finishes(
        tmp_path, monkeypatch):
    # what close() does for the Trainer's own workers, the harness does for its worker: a
    # checkpoint asked for after fit() returned is written of the final weights and acked
    fit_returned = threading.Event()
    fit = Trainer.fit

    def fit_then_say_so(self, **kw):
        fit(self, **kw)
        fit_returned.set()

    monkeypatch.setattr(Trainer, "fit", fit_then_say_so)
    asker = LateAsker(fit_returned)
    trainer, worker = run_with_worker([asker], tmp_path, max_duration="3ep")
    assert asker.ack is not None and asker.ack.ok, asker.ack
    assert asker.ack.result["step"] == trainer.timestamp.batch == 24
    assert trainer.checkpoints == [asker.ack.result["path"]] and worker.stats.errors == 0


def test_state_is_read_only_with_a_clear_error(tmp_path):
    mutator = Mutator()
    run_with_worker([mutator], tmp_path, max_duration="2ba")
    assert mutator.error.startswith("cannot set state.loss: State is read-only")
    assert "self.halt(reason)" in mutator.error
    assert len(mutator.nested_errors) == 2 * 4  # every nested change refused, on both batches
    dicts, timestamps = mutator.nested_errors[0:3] + mutator.nested_errors[4:7], mutator.nested_errors[3::4]
    assert all("State is read-only" in error for error in dicts)
    assert all(error.startswith("cannot set timestamp.batch: a Timestamp is read-only") for error in timestamps)


def test_worker_subscribes_only_to_what_its_callbacks_implement(tmp_path):
    class EpochOnly(Callback):
        def epoch_start(self, state, logger):
            pass

    class Everything(Callback):
        def run_event(self, event, state, logger):
            pass

    from offloop.bus import RunInfo

    info = RunInfo("x", "x", os.getpid(), 0.0, {"events": "tcp://127.0.0.1:1"})
    assert "epoch_start" in CallbackRuntime(info, [EpochOnly()]).topics()
    assert CallbackRuntime(info, [EpochOnly()]).topics() == {
        "epoch_start", "init", "fit_start", "eval_end", "fit_end"}  # no per-batch event

    class EpochReadsLoss(EpochOnly):
        state_topics = frozenset({"batch_end"})

    assert "batch_end" in CallbackRuntime(info, [EpochReadsLoss()]).topics()
    assert CallbackRuntime(info, [EpochOnly(), Everything()]).topics() is None


def test_composer_docs_example_runs_unchanged_but_for_the_import(tmp_path, capsys):
    namespace: dict = {}
    exec(  # the example from Composer's callback docs, with offloop's import line
        "from workers import Callback, Event, Logger, State\n"
        "class EpochMonitor(Callback):\n"
        "    def run_event(self, event: Event, state: State, logger: Logger):\n"
        "        if event == Event.EPOCH_START:\n"
        "            print(f'Epoch: {state.timestamp.epoch}')\n", namespace)
    run_with_worker([namespace["EpochMonitor"]()], tmp_path, max_duration="2ep")
    out = capsys.readouterr().out
    assert "Epoch: 0\n" in out and "Epoch: 1\n" in out and out.count("Epoch: ") == 2


def test_worker_counts_events_and_time_per_callback_and_event(tmp_path):
    log = MemoryLog()
    _, worker = run_with_worker([Tracer("t", []), Tracer("u", [])], tmp_path, max_duration="3ba",
                                destinations=[log])
    stats = worker.stats.as_dict()
    assert stats["events"] >= 3 and stats["gaps"] == 0
    # two callbacks of one class are timed apart
    assert set(stats["seconds"]) == {"Tracer", "Tracer#2"}
    assert set(stats["seconds"]["Tracer"]) == set(stats["seconds"]["Tracer#2"]) == {"batch_end"}


def test_specs_are_parsed_safely():
    assert parse_spec('EarlyStopper(monitor="acc", dataloader_label="eval", patience=2)') == (
        "EarlyStopper", [], {"monitor": "acc", "dataloader_label": "eval", "patience": 2})
    assert parse_spec("pkg.mod:Cls(1, [2, 3])") == ("pkg.mod:Cls", [1, [2, 3]], {})
    for bad in ['X(a=open("f"))', "X(**{'a': 1})", "X(", "(1)"]:
        with pytest.raises(SpecError):
            parse_spec(bad) if bad != "(1)" else build_callback(bad)
    with pytest.raises(SpecError, match="unknown callback 'Nope'"):
        build_callback("Nope")
    with pytest.raises(SpecError, match="Tracer"):
        build_callback("test_worker_runtime:Tracer(1, 2, 3, 4)")


def test_a_spec_names_a_callback_class_never_a_function(tmp_path):
    marker = tmp_path / "ran"
    for spec, what in ((f"os:system('touch {marker}')", "a builtin_function_or_method"),
                       ("subprocess:Popen(['true'])", "the class Popen"),
                       ("json:loads('1')", "a function")):
        with pytest.raises(SpecError, match=f"is {what}, not a Callback class"):
            build_callback(spec)
    assert not marker.exists()


def _offloop(*args, **kw):
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{TESTS}"}
    return subprocess.Popen([sys.executable, "-m", "offloop.cli", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _wait_for_batch(run_dir: Path, batch: int, timeout: float = 30) -> None:
    """Until the run has published the batch_end of `batch`, as a subscriber of our own sees."""
    from offloop.bus import Subscriber, read_run_info

    endpoints = read_run_info(run_dir).endpoints
    with Subscriber(endpoints["events"], endpoints["state"], topics=["batch_end"],
                    heartbeat_timeout=timeout) as sub:
        state = sub.connect(join_timeout=timeout)
        if any(entry.ts[1] >= batch for entry in state.entries):
            return
        deadline = time.monotonic() + timeout
        while (msg := sub.recv(timeout=max(0.0, deadline - time.monotonic()))) is not None:
            if msg.ts[1] >= batch:
                return
    raise AssertionError(f"the run never reached batch {batch}")


def test_worker_process_joins_a_run_under_way_and_exits_at_fit_end(spawn, tmp_path):
    run_dir = tmp_path / "run"
    trainer = spawn("slow_trainer", run_dir, 60, 0.05)
    trainer.line()
    wait_for_file(run_dir / "run.json")
    _wait_for_batch(run_dir, 2)  # the run is under way: the worker must join mid-run
    report = tmp_path / "probe.json"
    worker = _offloop("worker", str(run_dir), f"helpers.probes:JoinProbe({str(report)!r})", "--quiet")
    out, err = worker.communicate(timeout=60)
    assert worker.returncode == 0, err
    assert "reached fit_end" in err
    seen = json.loads(report.read_text())
    assert seen["first"]["batch"] > 1  # joined under way
    assert seen["first"]["run_name"] == "run" and seen["first"]["max_duration"] == "60ba"
    assert seen["last_batch"] == 60
    assert seen["count"] == 60 - seen["first"]["batch"] + 1  # every batch_end after joining
    # niced by 10 by default, every thread of it (ZeroMQ's included), as the trainer's own workers
    assert seen["first"]["nice"] == [min(19, os.getpriority(os.PRIO_PROCESS, 0) + 10)]
    assert trainer.line(timeout=30)["done"] == 60


def test_worker_notices_a_killed_trainer_closes_its_callbacks_and_exits(spawn, tmp_path):
    run_dir = tmp_path / "run"
    trainer = spawn("slow_trainer", run_dir, 1000, 0.05)
    trainer.line()
    wait_for_file(run_dir / "run.json")
    report = tmp_path / "probe.json"
    worker = _offloop("worker", str(run_dir), f"helpers.probes:JoinProbe({str(report)!r})", "--quiet",
                      "--heartbeat-timeout", "1", "--give-up-after", "3")
    wait_for_file(Path(str(report) + ".first"))
    os.kill(trainer.popen.pid, signal.SIGKILL)
    out, err = worker.communicate(timeout=30)
    assert worker.returncode == 3, err
    # reported at the heartbeat timeout, given up after --give-up-after
    assert "for 1s: partitioned or trainer gone; waiting up to 3s" in err
    assert "fell silent" in err and "no heartbeat" in err and "for 3s" in err
    assert json.loads(report.read_text())["count"] > 0  # close() ran


def test_worker_cli_refuses_unknown_runs_and_bad_specs(tmp_path):
    proc = _offloop("worker", str(tmp_path / "nope"), "helpers.probes:JoinProbe('x')",
                    "--runs-root", str(tmp_path))
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2 and "no run" in err
    proc = _offloop("worker", "x", "Nope(")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2 and "callback spec 'Nope('" in err
    for bad in ("20", "-1", "ten"):
        proc = _offloop("worker", "x", "LRMonitor", "--nice", bad)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 2 and f"argument --nice: must be an int between 0 and 19, got '{bad}'" in err


class _Counts(Callback):
    """Reads the worker's loss accounting from the State, as the Prometheus exporter does."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int | None, int]] = []
        self.final_gaps: int | None = None

    def batch_end(self, state, logger) -> None:
        self.seen.append((state.events_received, state.publisher_drops, state.gaps))

    def fit_end(self, state, logger) -> None:
        self.final_gaps = state.gaps


def test_state_carries_the_publishers_drops_and_the_events_received():
    import threading

    from offloop.bus import Publisher, RunInfo

    pub = Publisher("drop-run", queue_size=1, heartbeat_interval=0.05)
    endpoints = pub.start()
    counts = _Counts()
    worker = CallbackRuntime(RunInfo("drop-run", "drop-run", os.getpid(), time.time(), endpoints),
                             [counts], destinations=[MemoryLog()], heartbeat_timeout=30)
    worker.connect()
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(worker.run()), daemon=True)
    thread.start()
    try:
        for i in range(20000):  # a queue of one message: some of these are dropped, and counted
            pub.publish("batch_end", (0, i, i, i, 0), {"pad": b"x" * 4096})
        assert pub.stats.drops > 0
        deadline = time.monotonic() + 20
        # once a heartbeat with the drops has come, the next event's State carries them (a
        # heartbeat shares the queue of one, so an event sent here may be dropped too: the
        # count to match is the publisher's at each check)
        while not (counts.seen and counts.seen[-1][1] == (drops := pub.stats.drops)) and time.monotonic() < deadline:
            time.sleep(0.1)
            pub.publish("batch_end", (0, 20000, 20000, 20000, 0), {})
        while not pub.publish("fit_end", (1, 20000, 0, 20000, 0), {"stopped_by": None}):
            assert time.monotonic() < deadline, "fit_end was dropped every time"
            time.sleep(0.01)  # the queue of one held a heartbeat: the worker takes it, then this
        thread.join(timeout=30)
    finally:
        pub.close(linger=0.1)
    assert codes == [0]
    received, seen_drops, gaps = counts.seen[-1]
    assert seen_drops == drops > 0  # the last event's State said what the publisher had dropped
    assert received == worker.stats.events - 1  # every event but the fit_end after it
    # the last event's State counts every gap (a fit_end sent again after a drop is one more)
    assert gaps <= counts.final_gaps == worker.stats.gaps > 0
