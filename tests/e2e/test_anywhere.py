"""Callbacks work wherever users write Python: a script with no `__main__` guard, code piped
to `python -`, `python -c`, a Jupyter notebook, with callback classes defined right there;
the user's code runs once. A callback that cannot start is an error before training."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from offloop.trainer import ConfigError, Trainer
from offloop.workers import Callback

ROOT = Path(__file__).resolve().parents[2]

#: A user's training code, top to bottom, with no guard. Its callback class is its own.
USER_CODE = textwrap.dedent('''
    import json, sys
    import torch
    from offloop import Trainer, Callback
    from offloop.callbacks import LRMonitor

    print("USER CODE RAN", flush=True)

    class EpochLog(Callback):
        def __init__(self, path):
            self.path = path

        def epoch_end(self, state, logger):
            with open(self.path, "a") as out:
                out.write(json.dumps({"epoch": state.timestamp.epoch, "batch": state.timestamp.batch}) + "\\n")

    torch.manual_seed(0)
    x = torch.randn(64, 4)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long()), batch_size=16)
    trainer = Trainer(torch.nn.Linear(4, 2), loader, "2ep", loss_fn=torch.nn.functional.cross_entropy,
                      callbacks=[EpochLog(EPOCHS), LRMonitor()], run_dir=RUN_DIR,
                      log_to_console=True)
    trainer.fit()
    trainer.close()
    print("TRAINED", trainer.timestamp.batch, flush=True)
''')

#: what EpochLog writes for a 2-epoch run of 4 batches an epoch
EPOCHS_SEEN = [{"epoch": 1, "batch": 4}, {"epoch": 2, "batch": 8}]


def user_code(tmp_path: Path) -> str:
    return f"EPOCHS = {str(tmp_path / 'epochs.jsonl')!r}\nRUN_DIR = {str(tmp_path / 'run')!r}\n" + USER_CODE


def run_python(args: list[str], tmp_path: Path, stdin: str | None = None) -> subprocess.CompletedProcess:
    # the user's folder holds modules named like ours; they must not matter
    for name in ("trainer", "bus", "workers"):
        (tmp_path / f"{name}.py").write_text("raise ImportError('the user module shadowed ours')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, *args], cwd=tmp_path, input=stdin, capture_output=True,
                          text=True, timeout=180, env=env)


def assert_trained_once_with_its_callbacks(done: subprocess.CompletedProcess, tmp_path: Path) -> None:
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("USER CODE RAN") == 1, done.stdout  # not again in any worker
    assert "TRAINED 8" in done.stdout
    assert "lr-SGD/group0" in done.stdout + done.stderr  # the built-in LRMonitor logged from its worker
    epochs = [json.loads(line) for line in (tmp_path / "epochs.jsonl").read_text().splitlines()]
    assert epochs == EPOCHS_SEEN  # the callback defined in the user's code ran in its worker
    assert "Traceback" not in done.stderr and "exited with code" not in done.stderr, done.stderr[-3000:]


def test_a_script_without_a_main_guard_trains_with_the_callbacks_it_defines(tmp_path):
    script = tmp_path / "train_it.py"
    script.write_text(user_code(tmp_path))
    assert_trained_once_with_its_callbacks(run_python([str(script)], tmp_path), tmp_path)


def test_code_piped_to_python_stdin_trains_with_the_callbacks_it_defines(tmp_path):
    assert_trained_once_with_its_callbacks(run_python(["-"], tmp_path, stdin=user_code(tmp_path)), tmp_path)


def test_code_given_to_python_c_trains_with_the_callbacks_it_defines(tmp_path):
    assert_trained_once_with_its_callbacks(run_python(["-c", user_code(tmp_path)], tmp_path), tmp_path)


def shadowing_folder(folder: Path) -> Path:
    """A working directory like a clone's root or the image's WORKDIR: a partial `offloop/` of
    its own, and packages and modules named like ours. Importing any of them fails."""
    for package in ("offloop", "bus", "workers"):
        (folder / package).mkdir(parents=True)
        (folder / package / "__init__.py").write_text(
            f"raise ImportError('the working directory\\'s {package}/ shadowed the installed one')\n")
    (folder / "trainer.py").write_text("raise ImportError('the working directory\\'s trainer.py shadowed ours')\n")
    return folder


def test_a_script_run_from_a_folder_holding_its_own_offloop_starts_its_workers_from_the_installed_one(tmp_path):
    # the script lives elsewhere with a module of callbacks beside it (pickled by reference)
    code = tmp_path / "code"
    code.mkdir()
    (code / "beside.py").write_text(textwrap.dedent("""
        from offloop import Callback

        class FitEndMark(Callback):
            def __init__(self, path):
                self.path = path

            def fit_end(self, state, logger):
                with open(self.path, "w") as out:
                    out.write(type(self).__module__)
    """))
    script = code / "train_it.py"
    script.write_text(user_code(tmp_path).replace(
        "callbacks=[EpochLog(EPOCHS), LRMonitor()]",
        f"callbacks=[EpochLog(EPOCHS), LRMonitor(), __import__('beside').FitEndMark({str(tmp_path / 'mark')!r})]"))
    work = shadowing_folder(tmp_path / "work")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, str(script)], cwd=work, capture_output=True, text=True,
                          timeout=180, env=env, stdin=subprocess.DEVNULL)
    assert_trained_once_with_its_callbacks(done, tmp_path)
    assert (tmp_path / "mark").read_text() == "beside"  # the module beside the script, found in the worker


def test_the_installed_offloop_command_runs_from_a_folder_holding_its_own_offloop(tmp_path):
    work = shadowing_folder(tmp_path / "work")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OFFLOOP_RUNS")}
    done = subprocess.run([str(Path(sys.executable).parent / "offloop"), "demo", "--max-duration", "2ep"],
                          cwd=work, capture_output=True, text=True, timeout=180, env=env,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "eval accuracy" in done.stdout and "shadowed" not in done.stderr


def test_a_notebook_trains_with_a_callback_defined_in_one_of_its_cells(tmp_path):
    nbformat = pytest.importorskip("nbformat")  # in the test extra: skipped only outside it
    nbclient = pytest.importorskip("nbclient")
    definitions, training = _cells(user_code(tmp_path))
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(definitions),
                                               nbformat.v4.new_code_cell(training)])
    nbclient.NotebookClient(notebook, kernel_name="python3", timeout=180,
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o.get("text", "") for cell in notebook.cells for o in cell.outputs if o.get("name") == "stdout"]
    text = "".join(outputs)
    assert text.count("USER CODE RAN") == 1 and "TRAINED 8" in text, text
    assert [json.loads(line) for line in (tmp_path / "epochs.jsonl").read_text().splitlines()] == EPOCHS_SEEN


def _cells(code: str) -> tuple[str, str]:
    """The user's code as two notebook cells: imports and the callback class, then training."""
    split = code.index("torch.manual_seed(0)")
    return code[:split], code[split:]


# ------------------------------------------------------------ cannot start: an error first


class _HoldsALock(Callback):
    def __init__(self) -> None:
        self.lock = threading.Lock()


class _BreaksWhenRebuilt(Callback):
    def __init__(self) -> None:
        self.licence = "site-wide"

    def __setstate__(self, state) -> None:
        raise RuntimeError("the license server is unreachable")


def _trainer(tmp_path: Path, callback: Callback) -> Trainer:
    return Trainer(torch.nn.Linear(4, 2), [(torch.randn(8, 4), torch.randint(0, 2, (8,)))], "1ba",
                   loss_fn=F.cross_entropy, callbacks=[callback], run_dir=tmp_path / "run")


def test_a_callback_that_cannot_be_serialised_is_an_error_naming_it_before_any_worker_starts(tmp_path):
    with pytest.raises(ConfigError) as raised:
        _trainer(tmp_path, _HoldsALock())
    message = str(raised.value)
    assert message.startswith("callback _HoldsALock cannot be sent to its worker process: TypeError")
    assert "lock" in message and "\n" not in message
    assert not (tmp_path / "run").exists()  # refused before a socket, a worker or run.json


def test_a_callback_that_raises_while_rebuilt_in_its_worker_is_an_error_before_training(tmp_path):
    with pytest.raises(ConfigError) as raised:
        _trainer(tmp_path, _BreaksWhenRebuilt())
    assert str(raised.value) == (
        "callback _BreaksWhenRebuilt could not be started in its worker process: cannot be rebuilt "
        "in its worker process: RuntimeError: the license server is unreachable")
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["finished"] and run["extra"]["progress"]["batch"] == 0  # the run ended, untrained


def test_a_callback_whose_class_its_worker_cannot_import_is_an_error_before_training(tmp_path):
    # a class pickled by reference to a module only the trainer's process has
    ghost = type(sys)("offloop_ghost_module")
    exec("from offloop.workers import Callback\nclass Ghost(Callback):\n    pass\n", ghost.__dict__)
    sys.modules["offloop_ghost_module"] = ghost
    try:
        with pytest.raises(ConfigError, match=r"^callback Ghost could not be started in its worker process: "
                                              r"cannot be rebuilt in its worker process: ModuleNotFoundError: "
                                              r"No module named 'offloop_ghost_module'$"):
            _trainer(tmp_path, ghost.Ghost())
    finally:
        del sys.modules["offloop_ghost_module"]
