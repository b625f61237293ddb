# Quick start: `make demo` runs the main job, `make test` runs the tests.
# Each target does all set-up first: a virtual environment with the pinned CPU torch
# installed before the project, so the project's torch range is already satisfied.
# `make demo` installs the project with its `demo` extra only (scikit-learn, the demo's
# dataset); `make test` adds the `test` extra (the integrations' libraries, pytest, ...),
# which the demo does not need. `offloop` is then .venv/bin/offloop (on PATH after
# `. .venv/bin/activate`).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO_STAMP := $(VENV)/.offloop-demo-installed
TEST_STAMP := $(VENV)/.offloop-test-installed
TORCH_PIN := torch==2.13.0

.PHONY: demo test bench lint setup system-deps clean

$(DEMO_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet $(TORCH_PIN)
	$(BIN)/python -m pip install --quiet -e '.[demo]'
	touch $@

$(TEST_STAMP): $(DEMO_STAMP)
	$(BIN)/python -m pip install --quiet -e '.[demo,test]'
	touch $@

setup: $(TEST_STAMP)

system-deps:
	bash scripts/system-deps.sh

demo: $(DEMO_STAMP)
	$(BIN)/offloop demo

test: $(TEST_STAMP) system-deps
	$(BIN)/python -m pytest

lint: $(TEST_STAMP)
	$(BIN)/ruff check bus trainer workers offloop tests benchmarks

bench: $(TEST_STAMP)
	$(BIN)/python benchmarks/bus.py

clean:
	rm -rf $(VENV) runs .pytest_cache
