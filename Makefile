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

# The main job: search a plan for a built-in model on a 4-device CPU mesh (gloo), then
# train it for a few steps on 4 local processes beside a single-process reference.
demo: $(STAMP)
	mkdir -p out
	$(BIN)/autopar search llama-small --cluster cpu:4 --global-batch 8 --out out/demo-plan.json
	$(BIN)/autopar explain out/demo-plan.json
	$(BIN)/autopar train llama-small --devices 4 --plan out/demo-plan.json --steps 10 --check

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py
