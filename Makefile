# The README's two commands. Each creates .venv if missing and installs into it.
# `make test` lints (ruff, configured in pyproject.toml) before it runs the tests.
# torch is pinned to a CPU-capable build first, so the resolver never pulls CUDA wheels.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
# torchvision must be the release built for TORCH_SPEC (torch 2.13 <-> torchvision 0.28). It is optional:
# linattn.vision uses its NMS and CIoU when its compiled ops load, else OpenCV's NMS. PyPI's Linux
# torchvision wheels are built against CUDA torch and cannot even be imported next to the CPU build
# that TORCH_SPEC resolves to here, so none is installed by default; where TORCH_SPEC is PyPI's build:
#   make test TORCHVISION_SPEC=torchvision==0.28.0
TORCHVISION_SPEC ?=
STAMP := $(VENV)/.linattn-installed

.PHONY: demo test lint install clean docs

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)" $(if $(TORCHVISION_SPEC),"$(TORCHVISION_SPEC)")
	$(PY) -m pip install -q -e ".[dev,fla-models,vision,onnx]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m linattn demo

lint: $(STAMP)
	$(PY) -m ruff check src tests

# pytest-xdist: one worker per usable CPU (the affinity mask, not the machine's count), at most 4, and none (-n 0:
# in this process) on one CPU. Each worker imports torch and collects the whole suite (~0.7 GB of memory and a
# minute of CPU each), and past 4 the suite's longest tests and child processes, not the workers, bound its time.
# --dist loadgroup keeps the tests marked `xdist_group` with one name on one worker (tests/conftest.py).
# `make test TEST_WORKERS=0` runs the suite in one process.
TEST_WORKERS ?= $(shell $(PY) -c "import os; n = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') \
	else os.cpu_count() or 1; print(min(n, 4) if n > 1 else 0)")

test: lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup tests

# The documentation site (mkdocs.yml) into site/, --strict: a broken link or a docstring griffe cannot parse fails it.
# No network needed (no web fonts, no external scripts). Browse it with: $(PY) -m http.server -d site
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) build site *.egg-info src/*.egg-info
