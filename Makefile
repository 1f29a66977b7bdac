# The README's two commands. Each creates .venv if missing and installs into it.
# `make test` lints (ruff, configured in pyproject.toml) before it runs the tests.
# torch is pinned to a CPU-capable build first, so the resolver never pulls CUDA wheels.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.linattn-installed

.PHONY: demo test lint install clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m linattn demo

lint: $(STAMP)
	$(PY) -m ruff check src tests

test: lint
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
