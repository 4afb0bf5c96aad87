# turbollm — two commands on a fresh machine:
#   make run    create .venv, install turbollm, pull the default model, generate, then serve it
#   make test   install the test extras and run the test suite (`make test-fast`: the model-free tier alone)
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(PY) -m pip install --disable-pip-version-check -q
MODEL  ?= smollm2-135m
PROMPT ?= The three most useful things to know about the Python programming language are
MAX_TOKENS ?= 64
PORT   ?= 8000

.PHONY: run generate test test-fast install install-test browser clean models

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# torch==2.13.0 is pinned in pyproject.toml: the CPU build that lies on this machine's disk.
$(VENV)/.installed: $(VENV)/bin/python pyproject.toml
	$(PIP) -e .
	@touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) -e ".[test]"
	@touch $@

# The browser tests (tests/test_webui_browser.py, test_webui_failures.py) drive Debian's chromium package through Playwright;
# no browser is downloaded from anywhere else. Installed here when missing (root, or sudo without a
# password); when it cannot be, the test fails and says why.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
	  echo "installing Debian's chromium for the browser test"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO="sudo -n"; fi; \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null \
	  || { $$SUDO apt-get update -q >/dev/null && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null; } \
	  || echo "could not install chromium (apt-get as root): the browser tests will fail"; }

# the openai client, for the Python example `make run` prints
$(VENV)/.installed-client: $(VENV)/.installed
	$(PIP) -e ".[client]"
	@touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

# pull the model, generate once, then serve it (OpenAI API on 127.0.0.1:$(PORT); Ctrl-C stops)
run: generate $(VENV)/.installed-client
	@echo ""
	@echo "Serving $(MODEL) on http://127.0.0.1:$(PORT) (Ctrl-C stops). In another terminal:"
	@echo "  curl http://127.0.0.1:$(PORT)/v1/chat/completions -H 'Content-Type: application/json' \\"
	@echo "       -d '{\"model\": \"$(MODEL)\", \"messages\": [{\"role\": \"user\", \"content\": \"Hello!\"}], \"max_tokens\": 32}'"
	@echo "  $(PY) -c \"from openai import OpenAI; c = OpenAI(base_url='http://127.0.0.1:$(PORT)/v1', api_key='none'); \\"
	@echo "      print(c.chat.completions.create(model='$(MODEL)', messages=[{'role': 'user', 'content': 'Hello!'}], max_tokens=32).choices[0].message.content)\""
	@echo ""
	$(VENV)/bin/turbollm serve $(MODEL) --host 127.0.0.1 --port $(PORT)

generate: install
	$(VENV)/bin/turbollm pull $(MODEL)
	$(VENV)/bin/turbollm generate --model $(MODEL) --temperature 0 --max-tokens $(MAX_TOKENS) --prompt "$(PROMPT)"

models: install
	$(VENV)/bin/turbollm models

# strict: a kernel build or model download that fails is a test failure with the reason, not a skip
# (tests/conftest.py; `make test TURBOLLM_STRICT_TESTS=0` turns it off, CI=true turns it on anywhere)
TURBOLLM_STRICT_TESTS ?= 1
PYTEST = TURBOLLM_STRICT_TESTS=$(TURBOLLM_STRICT_TESTS) $(PY) -m pytest -q -ra
# the model-free tier: block pool, scheduler, hand-offs, formats, kernels against references, the layering rules
# (no catalog model; tests marked `model` or `slow` are the other tier)
FAST = -m "not model and not slow"
test-fast: install-test
	$(PYTEST) $(FAST) tests

# both tiers, the fast one first
test: test-fast browser
	$(PYTEST) -m "model or slow" tests

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
