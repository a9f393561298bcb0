# Two commands work on a fresh machine: `make test` and `make demo` (each builds .venv/ first).
# `make gpu` is for the GPU machine, where the packages are preinstalled: it installs nothing.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
EXTRAS := torch,jax,peft,demo,test

.PHONY: setup lint test demo gpu clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e '.[$(EXTRAS)]'
	touch $(STAMP)

setup: $(STAMP)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# Kernels run through the Triton interpreter (tests/conftest.py) and Pallas' GPU interpreter.
test: lint
	$(PY) -m pytest

demo: $(STAMP)
	$(PY) -m examples.demo

gpu:
	python3 -m benchmarks.run

clean:
	rm -rf $(VENV) out .pytest_cache .ruff_cache .hypothesis
