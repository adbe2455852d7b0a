# Two entry points for a fresh machine: `make demo` (the main job) and `make test` (the suite).
# Each creates .venv on first use and reinstalls only when pyproject.toml changes.
# GPU users: `make TORCH='torch' demo` (or any pip spec) to take a CUDA build instead of the CPU wheel.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH)" 2>&1 | grep -v "is ignored" || true
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]' 2>&1 | grep -v "is ignored" || true
	$(PY) -c "import torch, transformers, datasets, memtrain" && touch $@

.PHONY: demo test lint bench
demo: $(VENV)/.installed
	$(PY) -m memtrain demo

# worksteal: a few tests take 20-50 s each; an idle worker takes queued tests from the busy one, so the two end
# together (a suite on a 2-core Xeon: 18 s past half the tests' summed time, against 34 s under xdist's "load").
test: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 --dist worksteal --durations=15

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .

bench: $(VENV)/.installed
	$(PY) -m experiments.bench.engine
