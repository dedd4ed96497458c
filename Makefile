# Two entry points (README): `make demo` runs the main job, `make test` runs the tests.
# Both create .venv and install everything from this repository's own files.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.autopar-installed

.PHONY: demo test install bench bench-install bench-torchtitan

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

# The single-process tests on 2 workers (pytest-xdist); then the multi-process gloo tests, two
# files at a time (a file's ranks leave cores idle while its parent searches, traces or waits
# on a CLI process: one file at a time kept the cores 83% busy, two keep them 99% busy); then,
# one at a time, the tests marked `alone`, whose timeouts, timings or streamed output assume
# that no other test's ranks share the cores.
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 tests/unit tests/kernels
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not alone" tests/dist tests/bench
	$(BIN)/python -m pytest -q -m alone tests/dist

# `make bench` includes the torchtitan comparison when `make bench-install` was run, and
# prints one line saying it was skipped otherwise.
bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py

# The torchtitan baseline: the `bench` extra, then torchtitan 0.3.0 without its declared
# dependencies (its trainer's datasets/tensorboard/wandb/tokenizers/torchdata, which the
# benchmark never imports; pip cannot express --no-deps inside an extra). torch stays pinned.
bench-install: $(STAMP)
	$(BIN)/pip install -q -e ".[bench]"
	$(BIN)/pip install -q --no-deps torchtitan==0.3.0

# Only the autopar-vs-torchtitan measurement (rewrites benchmarks/results/torchtitan_*):
# re-run it whenever autopar's runtime changes.
bench-torchtitan: $(STAMP)
	$(BIN)/python benchmarks/measure_torchtitan.py --json benchmarks/results/torchtitan.json \
		--md benchmarks/results/torchtitan.md --plot benchmarks/results/torchtitan.png --profile-below 0.95
