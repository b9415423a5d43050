# `make train`: create .venv, install jaxpar with its test extras, run the default job.
# `make test`: the same environment, the whole test suite (8 emulated CPU devices).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: install train test inspect clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

train: $(STAMP)
	$(BIN)/python -m jaxpar.train $(ARGS)

inspect: $(STAMP)
	$(BIN)/python -m jaxpar.inspect $(ARGS) --human

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=15

clean:
	rm -rf $(VENV) runs
