"""Which process runs which callback: one shared worker process by default, callbacks run
there in the order given (as Composer runs them); `in_own_process()` for a heavy one."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import pytest
import torch
from helpers.trainers import loader, mlp

from offloop.trainer import Trainer, supervisor
from offloop.trainer.supervisor import process_groups
from offloop.workers import Callback


class Tag(Callback):
    """Appends (its tag, its pid, the batch) to one shared file at every batch_end."""

    def __init__(self, tag: str, path: str) -> None:
        self.tag, self.path = tag, path

    def batch_end(self, state, logger) -> None:
        with open(self.path, "a") as out:
            out.write(json.dumps([self.tag, os.getpid(), state.timestamp.batch]) + "\n")


class LeavesThingsOpen(Callback):
    """What a callback may leave to the end of its process: a file it never flushes or
    closes, a thread that is no daemon still writing, an atexit handler, a line printed
    without its newline."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def fit_start(self, state, logger) -> None:
        import atexit
        import threading

        self.out = open(os.path.join(self.folder, "unflushed.txt"), "w")  # noqa: SIM115

        def late() -> None:
            time.sleep(0.3)
            with open(os.path.join(self.folder, "thread.txt"), "w") as out:
                out.write("done")

        threading.Thread(target=late).start()
        atexit.register(Path(self.folder, "atexit.txt").write_text, "ran")

    def batch_end(self, state, logger) -> None:
        self.out.write(f"batch {state.timestamp.batch}\n")

    def close(self, state, logger) -> None:
        print("no newline at the end", end="")


def test_a_worker_ends_fast_yet_keeps_what_the_interpreters_exit_would(tmp_path, capfd):
    """A worker skips the interpreter's teardown (slow with torch imported); what that
    exit does that anyone sees is kept: unflushed files reach the disk, threads that are
    no daemons finish, atexit handlers run, a partial last line is printed."""
    trainer = Trainer(mlp(), loader(32, 8), "1ep", loss_fn=torch.nn.functional.cross_entropy,
                      callbacks=[LeavesThingsOpen(str(tmp_path))], run_dir=tmp_path / "run")
    trainer.fit()
    trainer.close()
    assert (tmp_path / "unflushed.txt").read_text() == "".join(f"batch {b}\n" for b in range(1, 5))
    assert (tmp_path / "thread.txt").read_text() == "done"
    assert (tmp_path / "atexit.txt").read_text() == "ran"
    assert trainer.workers.workers[0].process.exitcode == 0
    assert "no newline at the end" in capfd.readouterr().out


def test_callbacks_share_one_process_in_order_unless_one_asks_for_its_own(tmp_path):
    log = str(tmp_path / "tags.jsonl")
    callbacks = [Tag("a", log), Tag("b", log), Tag("heavy", log).in_own_process(),
                 Tag("up1", log).in_own_process("uploads"), Tag("c", log), Tag("up2", log).in_own_process("uploads")]
    trainer = Trainer(mlp(), loader(32, 8), "1ep", loss_fn=torch.nn.functional.cross_entropy,
                      callbacks=callbacks, run_dir=tmp_path / "run")
    assert [w.names for w in trainer.workers.workers] == [["Tag", "Tag", "Tag"], ["Tag"], ["Tag", "Tag"]]
    trainer.fit()
    trainer.close()
    rows = [json.loads(line) for line in Path(log).read_text().splitlines()]
    pid = {tag: {p for t, p, _ in rows if t == tag} for tag in ("a", "b", "c", "heavy", "up1", "up2")}
    assert all(len(p) == 1 for p in pid.values()), pid  # no callback moved between processes
    assert pid["a"] == pid["b"] == pid["c"] and pid["up1"] == pid["up2"]
    assert len(pid["a"] | pid["heavy"] | pid["up1"]) == 3 and os.getpid() not in pid["a"] | pid["heavy"] | pid["up1"]
    shared = [(t, batch) for t, p, batch in rows if p in pid["a"]]
    assert shared == [(t, batch) for batch in range(1, 5) for t in ("a", "b", "c")]  # in order, event by event
    assert sum(1 for t, _, _ in rows if t == "heavy") == 4


def test_process_groups_keep_the_given_order_with_the_shared_process_first():
    a, b, c = Callback(), Callback().in_own_process("x"), Callback()
    d = Callback().in_own_process()
    assert process_groups([b, a, d, c]) == [[a, c], [b], [d]]
    assert process_groups([b]) == [[b]]  # no empty shared process
    assert process_groups([]) == []


@pytest.mark.parametrize("name", ["", 3])
def test_a_bad_process_name_is_refused_by_name(name):
    with pytest.raises(ValueError, match=r"in_own_process\(name=...\) must be a non-empty str, got"):
        Callback().in_own_process(name)


class Slow(Callback):
    def batch_end(self, state, logger) -> None:
        time.sleep(0.05)


def test_close_says_how_far_behind_a_busy_worker_is_and_waits_no_longer_than_its_timeout(tmp_path, caplog):
    data = [(torch.randn(4, 8), torch.randint(0, 3, (4,))) for _ in range(200)]  # 10 s of Slow's work
    trainer = Trainer(mlp(), data, "1ep", loss_fn=torch.nn.functional.cross_entropy, callbacks=[Slow()],
                      run_dir=tmp_path / "run", worker_shutdown_timeout=2)
    trainer.fit()
    with caplog.at_level(logging.WARNING, logger="offloop.trainer"):
        closing = time.monotonic()
        trainer.close()
        took = time.monotonic() - closing
    said = [r.getMessage() for r in caplog.records]
    behind = [m for m in said if "callback worker Slow is at batch" in m]
    assert len(behind) == 1 and " of 200 (" in behind[0] and "behind" in behind[0], said
    assert "close() waits up to 2s for it (worker_shutdown_timeout)" in behind[0]
    assert any("Slow was still behind; terminating it" in m for m in said), said
    assert not any("exited with code" in m for m in said), said  # ended by close(), not a crash
    assert took < 2 + 5, f"close() took {took:.1f}s with worker_shutdown_timeout=2"  # not the 10 s backlog


def test_workers_report_their_progress_as_often_as_the_trainer_asks(tmp_path, monkeypatch):
    """The interval travels to the worker with its settings (host_cost.py scales it with the
    other timers under valgrind); each report lands in the supervisor's note_progress."""
    monkeypatch.setattr(supervisor, "PROGRESS_EVERY", 0.05)
    reports = []
    note = supervisor._WorkerProcess.note_progress
    monkeypatch.setattr(supervisor._WorkerProcess, "note_progress",
                        lambda worker, batch, now: (reports.append(now), note(worker, batch, now)))
    data = [(torch.randn(4, 8), torch.randint(0, 3, (4,))) for _ in range(30)]  # 1.5 s of Slow's work
    with Trainer(mlp(), data, "1ep", loss_fn=torch.nn.functional.cross_entropy, callbacks=[Slow()],
                 run_dir=tmp_path / "run") as trainer:
        trainer.fit()
    # every 1 s (the default) would give 2 or 3 in these 1.5 s
    assert len(reports) >= 8, f"{len(reports)} progress reports"


def test_lines_printed_by_several_workers_into_one_pipe_arrive_whole_and_in_order(tmp_path):
    import re
    import subprocess
    import sys

    workers, batches, lines = 4, 40, 20  # 4 x 800 lines of 300 bytes: many pipe buffers' worth
    done = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "programs" / "chatty_trainer.py"),
                           str(workers), str(batches), str(lines), str(tmp_path / "run")],
                          capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    out = done.stdout.decode().splitlines()
    assert out[-1] == "done"
    pattern = re.compile(r"(w\d) (\d+) (\d+) x{280} (w\d)")
    seen: dict[str, list[tuple[int, int]]] = {f"w{k}": [] for k in range(workers)}
    for line in out[:-1]:
        match = pattern.fullmatch(line)
        assert match and match[1] == match[4], f"a line cut or glued to another: {line[:120]!r}"
        seen[match[1]].append((int(match[2]), int(match[3])))
    for tag, got in seen.items():  # every line of each worker, in the order it printed them
        assert got == [(b, i) for b in range(1, batches + 1) for i in range(lines)], tag
