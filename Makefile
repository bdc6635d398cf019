# Two commands do the whole set-up on a fresh machine, idempotently:
#   make test   venv + dependencies + default model, then ruff and the test suite
#   make serve  the same set-up, then `serve run deployments/dlite.yaml`
#               (HTTP 127.0.0.1:8000, gRPC :9000)
# The dependencies are `.[dev]`: the core library, its serve, train and bench extras and the
# dev tools (pyproject.toml); not `gpu` (flash-attn by hand) nor `llamacpp` (compiled here).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup test serve model kernels bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP) model kernels

# the C++ CPU kernels, built here and not by whichever process first loads a CPU target
# (a no-op load of ~2 s once they are built for these sources; runtime/kernel_build.py)
kernels: $(STAMP)
	$(BIN)/dlite-ray build-kernels

model: $(STAMP)
	$(BIN)/dlite-ray fetch-model

# the suite runs in file order; `make test SEED=N` shuffles it (pytest-randomly, seed N) to
# find tests that lean on each other's state (test_two_replicas did: a drill before the
# tool loop), and `make test SEED=N` again repeats that order
SEED ?=
ORDER = $(if $(SEED),-p randomly --randomly-seed=$(SEED),-p no:randomly)

test: setup
	$(BIN)/ruff check dlite_ray tests
	$(BIN)/mypy dlite_ray
	@echo "test order: $(ORDER)"
	$(BIN)/python -m pytest -q -x --durations=15 $(ORDER)

serve: setup
	$(BIN)/serve run deployments/dlite.yaml

# every published figure: docs/bench/results.json, report.md and plots (~45 min on 2 cores);
# `make bench ARGS=--quick` checks the harness in a few minutes (its figures are not for quoting)
bench: setup
	$(BIN)/dlite-ray bench-suite --out docs/bench $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
