# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch; an unpinned torch would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: venv demo test lint clean

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[test]"
	touch $@

venv: $(BIN)/.installed

demo: venv
	$(BIN)/hsdp demo

test: venv
	$(BIN)/ruff check hsdp tests examples benchmarks
	$(BIN)/lint-imports --no-cache
	$(BIN)/python -m pytest -q --durations=15 tests

lint: venv
	$(BIN)/ruff check hsdp tests examples benchmarks
	$(BIN)/lint-imports --no-cache

clean:
	rm -rf $(VENV) build *.egg-info
