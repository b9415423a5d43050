# `make train`: create .venv, install jaxpar with its test extras, run the default job.
# `make test`: the same environment plus the `gpu-compile` extra (the CUDA plugin and cuDNN, so
# that the tests compile real H100 programs on this GPU-less machine) and the .venv-hf sidecar,
# then ruff's lint and format check (pyproject.toml names the rules) and the whole suite on 8 emulated CPU devices.
#
# jax >= 0.12 needs Python >= 3.12; the project is tested on 3.12. PYTHON picks the interpreter:
# set it to override; otherwise python3.12 on PATH, else the newest 3.12.x that pyenv has, else
# any Python >= 3.12 (python3.13, python3 on PATH, then pyenv's newest).
ifndef PYTHON
PYTHON := $(shell \
  ok() { "$$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; }; \
  root=$$(pyenv root 2>/dev/null || echo $$HOME/.pyenv); \
  newest() { ls -1 $$root/versions 2>/dev/null | grep -E "$$1" | sort -t. -k1,1nr -k2,2nr -k3,3nr; }; \
  for p in python3.12 \
           $$(newest '^3\.12\.[0-9]+$$' | sed "s|.*|$$root/versions/&/bin/python3|") \
           python3.13 python3 \
           $$(newest '^3\.(1[3-9]|[2-9][0-9])\.[0-9]+$$' | sed "s|.*|$$root/versions/&/bin/python3|"); do \
    if ok $$p; then command -v $$p; exit 0; fi; \
  done)
endif

VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
GPU_STAMP := $(VENV)/.installed-gpu-compile
ARGS ?=

.PHONY: install install-gpu-compile train test inspect clean python hf-reference

python:
	@if [ -z "$(PYTHON)" ]; then \
	  echo "error: jaxpar needs Python >= 3.12 (jax >= 0.12); none on PATH or under pyenv. Install one, or run make PYTHON=/path/to/python3.12" >&2; exit 2; fi
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 12))' || { \
	  echo "error: PYTHON=$(PYTHON) is $$($(PYTHON) --version 2>&1); jaxpar needs Python >= 3.12 (jax >= 0.12)" >&2; exit 2; }
	@echo "make: using $(PYTHON) ($$($(PYTHON) --version 2>&1))"

$(STAMP): pyproject.toml | python
	@if [ -x $(BIN)/python ] && ! $(BIN)/python -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then \
	  echo "make: $(VENV) has Python < 3.12; recreating it"; rm -rf $(VENV); fi
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[test]"
	touch $(STAMP)

# The CUDA plugin, cuDNN and ptxas (about 3 GB of wheels; no GPU driver needed).
$(GPU_STAMP): $(STAMP)
	$(BIN)/pip install --quiet -e ".[test,gpu-compile]"
	touch $(GPU_STAMP)

# The Hugging Face reference for tests/test_convert.py: CPU torch + transformers in a separate
# Python 3.11 environment (PyPI's Linux torch wheels for jaxpar's Python need the CUDA libraries).
# A CPU torch wheel in /opt/wheels is used when there is one, else torch from PyPI.
HF_VENV := .venv-hf
HF_PYTHON ?= python3.11
HF_STAMP := $(HF_VENV)/.installed
TORCH_WHEEL := $(firstword $(wildcard /opt/wheels/torch-*+cpu-cp311-*.whl))

$(HF_STAMP): pyproject.toml
	rm -rf $(HF_VENV)
	$(HF_PYTHON) -m venv $(HF_VENV)
	$(HF_VENV)/bin/pip install --quiet $(or $(TORCH_WHEEL),torch) $$($(HF_VENV)/bin/python -c \
	  'import tomllib; extra = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["hf-reference"]; print(" ".join(d for d in extra if not d.startswith("torch")))')
	touch $(HF_STAMP)

hf-reference: $(HF_STAMP)

.venv-hf: $(HF_STAMP)

install: $(STAMP)

install-gpu-compile: $(GPU_STAMP)

train: $(STAMP)
	$(BIN)/python -m jaxpar.train $(ARGS)

inspect: $(STAMP)
	$(BIN)/python -m jaxpar.inspect $(ARGS) --human

# Without Python 3.11 (or a torch for it) there is no .venv-hf: the suite still runs, and
# tests/test_convert.py says it skipped (CI, with JAXPAR_TESTS_REQUIRE_HF=1, fails instead).
test: $(GPU_STAMP)
	@$(MAKE) --no-print-directory hf-reference || echo "make: could not build $(HF_VENV); the Hugging Face parity tests will skip" >&2
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=15

clean:
	rm -rf $(VENV) $(HF_VENV) runs
