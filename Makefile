# Fresh machine: `make run` (the main job) or `make test` (set up, then the test suite).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
ARGS ?=
# pytest-xdist workers of `make test` / `make test-quick`: the end-to-end tests spend much of their time
# waiting on subprocesses and servers, so three workers (one intra-op thread each, tests/conftest.py)
# keep a 2-core machine busy; whole files go to one worker (--dist loadfile), so a module's fixtures
# are built once. docs/results/test_suite.md has the times of 2 and 3.
TEST_WORKERS ?= 3
# The SGLang release whose K3 code the interop suite (tests/interop) checks k3rl against; installed
# without its dependencies (they are CUDA builds), see the `interop` extra in pyproject.toml.
SGLANG_VERSION := 0.5.23

.PHONY: setup setup-run run test test-quick lint clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# pip byte-compiles what it installs (its default, about 30 s of setup): where PYTHONDONTWRITEBYTECODE
# is set, as on this workplace's machines and CI, an import never writes a .pyc, so without them
# every process compiles torch's and Prefect's sources again: a tiny `k3rl run` took 45 s instead
# of 21-26 (docs/results/test_suite.md), and the suite pays that for each of its hundreds of processes.
PIP := $(BIN)/python -m pip install -q

# What running needs: the pinned CPU build of torch first on machines without an NVIDIA GPU (a plain
# `torch` requirement would pull a multi-GB CUDA build), then k3rl itself.
setup-run: $(BIN)/python
	@if ! command -v nvidia-smi >/dev/null 2>&1; then \
	  $(BIN)/python -c "import torch" 2>/dev/null || $(PIP) torch==2.13.0; fi
	$(PIP) -e .

# What the tests need besides: the test extra (peer libraries, local S3, Dask, Ray) and the interop
# suite's SGLang.
setup: setup-run
	$(PIP) -e ".[test,interop]"
	$(PIP) --no-deps sglang==$(SGLANG_VERSION)

run: setup-run
	PYTHONUNBUFFERED=1 $(BIN)/k3rl run --preset small --run-id demo $(ARGS)

# The project's own modules byte-compiled first (about a second): the suite's hundreds of `k3rl run`
# processes import them, and where PYTHONDONTWRITEBYTECODE is set no import writes a .pyc.
BYTECODE := $(BIN)/python -m compileall -q k3core flows tasks tests benchmarks >/dev/null

# Every test (CI runs this).
test: setup
	$(BYTECODE)
	$(BIN)/python -m pytest tests -n $(TEST_WORKERS) --dist loadfile $(ARGS)

# The inner loop: every test not marked `slow` (an unmarked test may take at most 20 s, tests/conftest.py).
test-quick: setup
	$(BYTECODE)
	$(BIN)/python -m pytest tests -m "not slow" -n $(TEST_WORKERS) --dist loadfile $(ARGS)

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
