# turbollm — two commands on a fresh machine:
#   make run    create .venv, install turbollm, pull the default model, generate with it
#   make test   install the test extras and run the test suite
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(PY) -m pip install --disable-pip-version-check -q
MODEL  ?= smollm2-135m
PROMPT ?= The three most useful things to know about the Python programming language are
MAX_TOKENS ?= 64

.PHONY: run test install install-test clean models

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# torch==2.13.0 is pinned in pyproject.toml: the CPU build that lies on this machine's disk.
$(VENV)/.installed: $(VENV)/bin/python pyproject.toml
	$(PIP) -e .
	@touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) -e ".[test]"
	@touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

run: install
	$(VENV)/bin/turbollm pull $(MODEL)
	$(VENV)/bin/turbollm generate --model $(MODEL) --temperature 0 --max-tokens $(MAX_TOKENS) --prompt "$(PROMPT)"

models: install
	$(VENV)/bin/turbollm models

test: install-test
	$(PY) -m pytest -q -ra tests

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
