# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch; an unpinned torch would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: venv demo test lint docs clean

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[test]"
	touch $@

venv: $(BIN)/.installed

demo: venv
	$(BIN)/hsdp demo

# The documentation site into build/site, warnings as errors (mkdocs.yml: strict): a broken link, a public
# name without a docstring or missing from the API reference fails it. Not --quiet: it drops the warnings,
# and the build passes. `.venv/bin/mkdocs serve` previews the site.
DOCS_BUILD := NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

docs: venv
	$(DOCS_BUILD)

test: venv
	$(BIN)/ruff check hsdp tests examples benchmarks docs/hooks
	$(BIN)/lint-imports --no-cache
	$(DOCS_BUILD)
	$(BIN)/python -m pytest -q --durations=60 tests

lint: venv
	$(BIN)/ruff check hsdp tests examples benchmarks docs/hooks
	$(BIN)/lint-imports --no-cache

clean:
	rm -rf $(VENV) build *.egg-info
