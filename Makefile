# Two commands on a fresh clone with only Python 3.11+: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-dev

.PHONY: demo test test-fast lint typecheck check-deps install clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(VENV)/bin/python
	# torch is pinned to 2.13.0 (a CPU build); installing it first keeps pip from pulling a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/relayrl demo

# Everything (what CI runs, .ci/run).
test: $(STAMP)
	$(PY) -m pytest -q -x -n 2 --durations=15

# The development lane: every test but those marked `slow` (multi-rank and Ray runs, async RL, kill -9 and
# signal subprocesses, whole learning runs); run `make test` before you push.
test-fast: $(STAMP)
	$(PY) -m pytest -q -x -n 2 -m "not slow" --durations=10

lint: $(STAMP)
	$(VENV)/bin/ruff check relayrl tests bench examples
	$(VENV)/bin/ruff format --check relayrl tests bench examples
	$(VENV)/bin/basedpyright --project pyproject.toml

typecheck: $(STAMP)
	$(VENV)/bin/basedpyright --project pyproject.toml

# Do `pip install -e '.[dev]'` (CPU pins) and `pip install -e '.[vllm]'` (GPU image pins) resolve? Metadata
# only (uv pip compile), ~25 s; skipped with a warning when the package index is unreachable (.ci/check_deps).
check-deps: $(STAMP)
	UV=$(VENV)/bin/uv .ci/check_deps

clean:
	rm -rf $(VENV) runs .pytest_cache
