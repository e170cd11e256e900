# Two commands on a fresh machine: `make demo` and `make test`.
# Each builds .venv when it is missing (or when pyproject.toml changed).
#
# TORCH_SPEC pins torch so that a CPU machine installs the local CPU build and
# never downloads a multi-GB CUDA build; override it on a GPU machine, e.g.
#   make test TORCH_SPEC='torch'
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvtriton-installed

.PHONY: venv test typecheck pytest demo clean

venv: $(STAMP)

# The last step adds vLLM 0.33.0 for the adapter tests without its CUDA stack:
# --no-deps never resolves, so the torch installed above stays
# (requirements-vllm.txt lists why each package is there).
$(STAMP): pyproject.toml Makefile requirements-vllm.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]" "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet --no-deps -r requirements-vllm.txt
	@touch $@

typecheck: $(STAMP)
	$(PY) -m pyright

pytest: $(STAMP)
	$(PY) -m pytest -q

test: typecheck pytest

demo: $(STAMP)
	$(VENV)/bin/kvtriton demo

clean:
	rm -rf $(VENV) build dist *.egg-info
