"""Checkpoint files at their edges: a write that fails part-way leaves the previous file and
no temporary one, a full disk is refused as a CheckpointError however torch wraps it, an
interrupt stays an interrupt, and a file name can never leave the checkpoint folder.
Each test is marked `guarantee` (written to kill mutants of trainer/checkpoint.py; they
were test_checkpoint_guarantees.py)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest
import torch
from helpers.fsyncs import record_fsyncs

from offloop.bus import ControlRequest
from offloop.bus.discovery import remove_stale_temporaries
from offloop.trainer.checkpoint import (
    check_filename,
    load_checkpoint,
    requested_name,
    save_checkpoint,
)
from offloop.trainer.errors import CheckpointError


class FailsWhenSaved:
    """A payload value whose pickling calls `fail` (which raises), after torch.save has
    begun writing the file."""

    def __init__(self, fail) -> None:
        self.fail = fail

    def __reduce__(self):
        self.fail()


def raise_(exc):
    def fail():
        raise exc
    return fail


def disk_full_inside_torch():
    # what torch.save raises on a full disk: a RuntimeError raised while handling the OSError
    try:
        raise OSError(errno.ENOSPC, "No space left on device")
    except OSError:
        raise RuntimeError("[enforce fail at inline_container.cc] unexpected pos")  # noqa: B904


@pytest.mark.guarantee
def test_a_write_that_fails_part_way_leaves_the_previous_checkpoint_whole_and_no_temporary_file(tmp_path):
    path = save_checkpoint(tmp_path / "ckpt.pt", {"weights": torch.arange(4)})
    with pytest.raises(ValueError, match="not picklable here"):
        save_checkpoint(path, {"weights": torch.zeros(1000), "bad": FailsWhenSaved(
            raise_(ValueError("not picklable here")))})
    assert torch.equal(load_checkpoint(path)["weights"], torch.arange(4))
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


@pytest.mark.guarantee
def test_a_full_disk_under_torchs_runtime_error_is_refused_as_a_checkpoint_error_naming_it(tmp_path):
    with pytest.raises(CheckpointError, match=r"cannot write checkpoint .*ckpt\.pt: No space left on device"):
        save_checkpoint(tmp_path / "ckpt.pt", {"w": torch.zeros(10), "x": FailsWhenSaved(disk_full_inside_torch)})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.guarantee
def test_an_interrupt_during_a_write_stays_an_interrupt_and_leaves_no_file(tmp_path):
    def interrupt():  # an interrupt while handling a write error: still not a CheckpointError
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise KeyboardInterrupt  # noqa: B904

    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path / "ckpt.pt", {"x": FailsWhenSaved(interrupt)})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.guarantee
def test_a_checkpoint_is_written_into_missing_folders(tmp_path):
    path = save_checkpoint(tmp_path / "a" / "b" / "ckpt.pt", {"step": 3})
    assert load_checkpoint(path) == {"step": 3}


@pytest.mark.guarantee
@pytest.mark.parametrize("name", ["../evil.pt", "a/b.pt", ".hidden.pt", "", "x" * 101 + ".pt",
                                  "sp ace.pt", 5])
def test_a_file_name_that_could_leave_the_folder_or_is_not_plain_is_refused(name):
    with pytest.raises(CheckpointError, match="must be a plain file name"):
        check_filename(name)


@pytest.mark.guarantee
@pytest.mark.parametrize("name", [None, "best.pt", "ep0-ba3_final.v2.pt", "x" * 100])
def test_a_plain_file_name_or_none_is_accepted(name):
    check_filename(name)


def request(**args) -> ControlRequest:
    return ControlRequest("client", 1, "checkpoint", args, 0.0)


@pytest.mark.guarantee
def test_requests_saved_together_join_their_cleaned_tags_and_take_the_first_file_name():
    assert requested_name([request(tag="best"), request(), request(tag="a/b", filename="x.pt"),
                           request(filename="y.pt")]) == ("best-a_b", "x.pt")
    assert requested_name([request(tag="..up")]) == ("up", None)
    assert requested_name([]) == ("sigterm", None)  # no request: a SIGTERM asked


class Arbitrary:
    """Not a tensor, a number or a container: what a weights_only load must refuse."""


@pytest.mark.guarantee
def test_a_checkpoint_holding_arbitrary_objects_is_refused_not_unpickled(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"model": {}, "payload": Arbitrary()}, path)  # unpickling it would run its class's code
    with pytest.raises(CheckpointError, match="is not a readable offloop checkpoint"):
        load_checkpoint(path)


@pytest.mark.guarantee
def test_a_tag_is_cut_to_a_hundred_characters_of_a_file_name():
    tag, _ = requested_name([request(tag="t" * 300)])
    assert tag == "t" * 100


@pytest.mark.guarantee
def test_an_exception_chain_that_loops_back_on_itself_is_no_full_disk_and_does_not_hang(tmp_path):
    first, second = RuntimeError("first"), RuntimeError("second")
    first.__context__, second.__context__ = second, first  # a cycle: no OSError anywhere
    with pytest.raises(RuntimeError, match="first"):
        save_checkpoint(tmp_path / "c.pt", {"x": FailsWhenSaved(raise_(first))})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.guarantee
def test_the_folder_is_fsynced_after_the_checkpoint_gets_its_name(tmp_path, monkeypatch):
    synced = record_fsyncs(monkeypatch)
    path = save_checkpoint(tmp_path / "ckpt" / "a.pt", {"x": torch.ones(2)})
    assert synced[-1] == str(tmp_path / "ckpt") and path.is_file()
    assert any(name.startswith(str(tmp_path / "ckpt" / ".a.pt.pid")) for name in synced[:-1])  # the file first


@pytest.mark.guarantee
def test_a_killed_writers_temporary_file_is_removed_and_a_live_ones_kept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    stale = folder / f".ep1-ba4.pt.pid{int(dead.stdout)}.abc123.tmp"
    live = folder / f".ep1-ba4.pt.pid{os.getpid()}.def456.tmp"
    other = folder / ".notes.tmp"
    for file in (stale, live, other):
        file.write_bytes(b"half")
    assert remove_stale_temporaries(folder) == [stale.name]
    assert not stale.exists() and live.exists() and other.exists()
    assert remove_stale_temporaries(tmp_path / "missing") == []


@pytest.mark.guarantee
def test_a_sigterm_while_the_publisher_sends_outside_fit_closes_the_run_instead_of_deadlocking(tmp_path):
    import json

    helper = os.path.join(os.path.dirname(os.path.dirname(__file__)), "programs", "sigterm_idle.py")
    done = subprocess.run([sys.executable, helper, str(tmp_path / "run")], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 143, done.stderr[-2000:]
    assert "not reached" not in done.stdout
    assert json.loads((tmp_path / "run" / "run.json").read_text())["finished"] is True
