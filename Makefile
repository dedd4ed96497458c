# Two entry points (README): `make demo` runs the main job, `make test` runs the tests.
# Both create .venv and install everything from this repository's own files.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.autopar-installed

.PHONY: demo test install bench

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: pip takes the CPU wheel on disk; an existing torch is kept.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/autopar trace llama-small --global-batch 4 --dtype float32

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py
