# Quick start: `make demo` runs the main job, `make test` runs the tests.
# Each target does all set-up first: a virtual environment with the pinned CPU torch
# installed before the project, so the project's torch range is already satisfied.
# The project goes in with its `demo` extra (scikit-learn, the demo's dataset) and its
# `test` extra; `offloop` is then .venv/bin/offloop (on PATH after `. .venv/bin/activate`).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.offloop-installed
TORCH_PIN := torch==2.13.0

.PHONY: demo test bench lint setup system-deps clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet $(TORCH_PIN)
	$(BIN)/python -m pip install --quiet -e '.[demo,test]'
	touch $(STAMP)

setup: $(STAMP)

system-deps:
	bash scripts/system-deps.sh

demo: $(STAMP)
	$(BIN)/offloop demo

test: $(STAMP) system-deps
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check bus trainer workers offloop tests benchmarks

bench: $(STAMP)
	$(BIN)/python benchmarks/bus.py

clean:
	rm -rf $(VENV) runs .pytest_cache
