# The two commands of the quickstart: `make demo` and `make test`.
# Each creates .venv if missing and installs the package with its test extra.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The oracle needs torch; pin the CPU-sized release so a fresh machine does not
# pull a multi-GB CUDA build just to run the tests.
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test test-slow lint bench-cache train-tiny clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

demo: $(VENV)/.installed
	$(PY) scripts/generate.py

test: $(VENV)/.installed
	$(PY) -m pytest -q

test-slow: $(VENV)/.installed
	$(PY) -m pytest -q -m slow

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .

bench-cache: $(VENV)/.installed
	$(PY) scripts/bench_cache.py

train-tiny: $(VENV)/.installed
	$(PY) scripts/train_tiny.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
