"""The import layout users rely on: `offloop` is the one name installed, a user's own
`trainer.py`, `bus.py` or `workers.py` never shadows ours, and dependencies flow one way."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers.packages import package_names

ROOT = Path(__file__).parent.parent.parent

USER_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from offloop import Callback, Event, Logger, State, Time, Timestamp, Trainer
    from offloop.callbacks import LRMonitor
    from offloop.loggers import JSONLLogger

    class Tally(Callback):
        '''Defined in the user's script: runs in a worker process the trainer spawns.'''

        def __init__(self, path):
            self.path, self.seen = path, []

        def batch_end(self, state: State, logger: Logger) -> None:
            self.seen.append(state.timestamp.batch)

        def fit_end(self, state, logger):
            with open(self.path, "w") as f:
                json.dump(self.seen, f)

    torch.manual_seed(0)  # no __main__ guard: the workers never import this script
    data = [(torch.randn(4, 8), torch.randint(0, 2, (4,))) for _ in range(6)]
    trainer = Trainer(torch.nn.Linear(8, 2), data, Time.parse("2ep"),
                      loss_fn=torch.nn.functional.cross_entropy, run_dir=sys.argv[1],
                      callbacks=[Tally(sys.argv[2]), LRMonitor()])
    trainer.fit()
    trainer.close()
    print(json.dumps({"batch": trainer.timestamp.batch, "event": Event.BATCH_END.value,
                      "timestamp": Timestamp.__module__}))
""")


def _clean_env() -> dict[str, str]:
    """The environment of a user's shell: nothing of the repository on the import path."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def test_user_files_named_like_our_folders_do_not_shadow_offloop(tmp_path):
    for name in ("trainer", "bus", "workers"):
        (tmp_path / f"{name}.py").write_text(f"raise ImportError('the user\\'s own {name}.py was imported')\n")
    (tmp_path / "train.py").write_text(USER_SCRIPT)
    seen = tmp_path / "seen.json"
    proc = subprocess.run([sys.executable, "train.py", str(tmp_path / "run"), str(seen)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=180,
                          stdin=subprocess.DEVNULL, env=_clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["batch"] == 12 and out["event"] == "batch_end"
    assert out["timestamp"].startswith("offloop.")
    assert json.loads(seen.read_text()) == list(range(1, 13))  # the worker saw every batch


@pytest.mark.parametrize("name", ["trainer", "bus", "workers"])
def test_only_offloop_is_installed_on_the_import_path(tmp_path, name):
    proc = subprocess.run([sys.executable, "-c", f"import {name}"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, env=_clean_env())
    assert proc.returncode != 0 and f"No module named '{name}'" in proc.stderr, proc.stderr


def test_the_one_import_line_resolves_without_torch_until_the_trainer_is_asked_for(tmp_path):
    code = ("import sys, offloop, offloop.bus, offloop.callbacks, offloop.loggers\n"
            "assert 'torch' not in sys.modules, 'offloop imported torch eagerly'\n"
            "from offloop import Trainer, Callback, Event, State, Logger, Time, Timestamp\n"
            "from offloop.callbacks import EarlyStopper, StopTrainingError\n"
            "print(Trainer.__module__, EarlyStopper.__module__)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, env=_clean_env())
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["offloop.trainer.trainer", "offloop.workers.callbacks.stoppers"]


def _imported_packages(folder: Path) -> dict[str, set[str]]:
    """For each module under `folder`, the offloop packages it imports (anywhere in it)."""
    found: dict[str, set[str]] = {}
    for path in folder.rglob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
        found[str(path.relative_to(ROOT))] = {n.split(".")[1] for n in names
                                              if n.startswith("offloop.") and n.count(".") >= 1}
    return found


@pytest.mark.parametrize(("package", "forbidden"), [
    ("bus", {"trainer", "workers", "callbacks", "loggers", "cli", "commands"}),
    ("trainer", {"workers", "callbacks", "loggers", "cli", "commands"}),
    ("workers", {"trainer", "cli", "commands"}),
])
def test_dependencies_flow_one_way(package, forbidden):
    imports = _imported_packages(ROOT / package)
    assert imports, f"no modules found under {package}/"
    offenders = {module: sorted(names & forbidden) for module, names in imports.items() if names & forbidden}
    assert not offenders, f"{package}/ must not import {sorted(forbidden)}: {offenders}"


def test_every_package_folder_is_installed():
    """pyproject.toml lists the packages by hand: a new subpackage left off the list would
    work from this checkout and be missing once installed."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = package_names()
    assert found == listed, f"missing from pyproject: {sorted(found - listed)}; listed, not found: {sorted(listed - found)}"


def test_the_checkouts_offloop_folder_is_the_whole_package(tmp_path):
    """bus/, trainer/ and workers/ are offloop/bus, offloop/trainer, offloop/workers
    (relative symlinks): no partial `offloop` exists for a working directory to put first,
    and a reader goes from `offloop.bus` to a folder."""
    for name in ("bus", "trainer", "workers"):
        link = ROOT / "offloop" / name
        assert link.is_symlink() and os.readlink(link) == f"../{name}", link
    # the clone's root first on the path, as `python -` or `python -m` there puts it
    code = ("import offloop.bus, offloop.trainer, offloop.workers.spawned as w, os; "
            "print(os.path.dirname(os.path.dirname(w.__file__)))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**_clean_env(), "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()) == ROOT / "offloop"


def test_no_bus_or_trainer_module_is_over_500_lines_and_the_publisher_facade_is_small():
    """trainer.py holds the loop alone and publisher.py the façade over the publisher's
    rooms; what grows around them gets a module of its own."""
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
             for folder in ("bus", "trainer") for p in (ROOT / folder).rglob("*.py")}
    assert not {name: n for name, n in sizes.items() if n > 500}
    assert sizes["bus/publisher.py"] <= 260, sizes["bus/publisher.py"]
