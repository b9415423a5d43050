# `make train`: create .venv, install jaxpar with its test extras, run the default job.
# `make test`: the same environment plus the `gpu-compile` extra (the CUDA plugin and cuDNN, so
# that the tests compile real H100 programs on this GPU-less machine), then the whole suite on 8
# emulated CPU devices.
#
# jax >= 0.12 needs Python >= 3.12. PYTHON picks the interpreter: set it to override; otherwise
# the first of python3.13, python3.12, python3 on PATH that is >= 3.12, else the newest >= 3.12
# that pyenv has installed.
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
GPU_STAMP := $(VENV)/.installed-gpu-compile
ARGS ?=

PYTHON ?= $(shell \
  for p in python3.13 python3.12 python3; do \
    command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null \
      && { command -v $$p; exit 0; }; \
  done; \
  root=$$(pyenv root 2>/dev/null || echo $$HOME/.pyenv); \
  for v in $$(ls -1 $$root/versions 2>/dev/null | grep -E '^3\.(1[2-9]|[2-9][0-9])\.[0-9]+$$' | sort -t. -k1,1n -k2,2n -k3,3n -r); do \
    [ -x $$root/versions/$$v/bin/python3 ] && { echo $$root/versions/$$v/bin/python3; exit 0; }; \
  done)

.PHONY: install install-gpu-compile train test inspect clean python

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

install: $(STAMP)

install-gpu-compile: $(GPU_STAMP)

train: $(STAMP)
	$(BIN)/python -m jaxpar.train $(ARGS)

inspect: $(STAMP)
	$(BIN)/python -m jaxpar.inspect $(ARGS) --human

test: $(GPU_STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=15

clean:
	rm -rf $(VENV) runs
