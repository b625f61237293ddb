"""The wheel as users install it: built from this checkout, installed (not editable) into a
fresh virtual environment, and run from the clone's root (which holds the repository's own
`offloop/` folder) and from an empty folder. The rest of the suite runs against the
editable install `make test` makes; this tier runs what `pip install offloop` gives.

Set-up costs about a minute (the venv, torch from pip's cache or local wheels, the `demo`
extra); it happens once for the module."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers.packages import package_names

ROOT = Path(__file__).resolve().parents[2]
SOURCES = {"pyproject.toml", "README.md", "offloop", "bus", "trainer", "workers"}
TORCH_PIN = next(line.split(":=", 1)[1].strip() for line in (ROOT / "Makefile").read_text().splitlines()
                 if line.startswith("TORCH_PIN :="))


def _run(args: list, cwd: Path, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, env=env)
    assert done.returncode == 0, f"{' '.join(map(str, args))}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done


def _user_env(venv: Path) -> dict[str, str]:
    """A user's shell with the fresh venv activated: nothing of the checkout on the path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OFFLOOP_RUNS", "VIRTUAL_ENV")}
    return {**env, "VIRTUAL_ENV": str(venv), "PATH": f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"}


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """(the wheel, the venv it is installed in)."""
    base = tmp_path_factory.mktemp("wheel")
    source = base / "source"  # what the Dockerfile copies: setuptools writes build/ beside it
    shutil.copytree(ROOT, source, ignore=lambda folder, names: [n for n in names if n not in SOURCES]
                    if Path(folder) == ROOT else ["__pycache__"])
    _run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", base / "dist", source],
         cwd=base)
    (wheel,) = (base / "dist").glob("offloop-*.whl")
    venv = base / "venv"
    _run([sys.executable, "-m", "venv", venv], cwd=base)
    pip = [venv / "bin" / "python", "-m", "pip", "install", "--quiet"]
    _run([*pip, TORCH_PIN], cwd=base)  # pinned first, as the Makefile does: no CUDA wheels
    _run([*pip, f"{wheel}[demo]"], cwd=base)
    return wheel, venv


def test_the_wheel_holds_every_subpackage_and_no_tests(installed):
    wheel, _ = installed
    names = zipfile.ZipFile(wheel).namelist()
    packages = {name.rsplit("/", 1)[0].replace("/", ".") for name in names if name.endswith("/__init__.py")}
    expected = package_names()  # the checkout's offloop/, its symlinked folders followed
    assert packages == expected, f"missing: {sorted(expected - packages)}; extra: {sorted(packages - expected)}"
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/", "deploy/")) or "/tests/" in n]


def test_the_installed_package_is_not_the_checkout(installed):
    _, venv = installed
    done = _run([venv / "bin" / "python", "-c", "import offloop.workers.spawned as m; print(m.__file__)"],
                cwd=Path("/"), env=_user_env(venv))
    assert Path(done.stdout.strip()).is_relative_to(venv), done.stdout


@pytest.mark.parametrize("where", ["the clone's root", "an empty folder"])
def test_offloop_demo_from_the_installed_wheel_runs_anywhere(installed, where, tmp_path):
    _, venv = installed
    cwd = ROOT if where == "the clone's root" else tmp_path
    run_dir = tmp_path / "runs" / "demo"
    done = _run([venv / "bin" / "offloop", "demo", "--max-duration", "3ep", "--run-dir", run_dir], cwd=cwd,
                timeout=300, env=_user_env(venv))
    assert "eval accuracy" in done.stdout, done.stdout[-2000:]
    assert "could not be started" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert (run_dir / "run.json").exists() and list(run_dir.glob("**/*.pt")), sorted(run_dir.rglob("*"))
