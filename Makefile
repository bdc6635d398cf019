# Two commands do the whole set-up on a fresh machine, idempotently:
#   make test   venv + dependencies + default model, then the test suite
#   make serve  the same set-up, then the default model (until Ray Serve lands: a
#               generation through the CLI)
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup test serve model bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP) model

model: $(STAMP)
	$(BIN)/dlite-ray fetch-model

test: setup
	$(BIN)/python -m pytest -q -x --durations=15

serve: setup
	$(BIN)/dlite-ray generate --prompt "Write a Python function that reverses a string." --max-new-tokens 64

bench: setup
	$(BIN)/dlite-ray bench-runtime

clean:
	rm -rf $(VENV) build *.egg-info
