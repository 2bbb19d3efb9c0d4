# Two entry points (see README): `make predict` and `make test`. Each bootstraps what it needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: predict test test-slow lint bench calibrate report clean

# The estimator's predict path is pure standard library: a bare venv with the package is enough.
$(VENV)/.installed-core: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -e .
	touch $@

# Everything else (torch==2.13.0 pinned: the local CPU wheel on these machines).
$(VENV)/.installed-dev: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]'
	touch $@ $(VENV)/.installed-core

predict: $(VENV)/.installed-core
	$(PY) -m estimator $(ARGS)

test: $(VENV)/.installed-dev
	$(PY) -m ruff check .
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-slow: $(VENV)/.installed-dev
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

lint: $(VENV)/.installed-dev
	$(PY) -m ruff check .

bench: $(VENV)/.installed-dev
	$(PY) benchmarks/bench_estimator.py

# Fit estimator/coefficients/<gpu>.json from data/measurements/ (ARGS: --gpu KEY, --dry-run, ...).
calibrate: $(VENV)/.installed-dev
	$(PY) -m calibrate fit $(ARGS)

report: $(VENV)/.installed-dev
	$(PY) -m calibrate report $(ARGS)

clean:
	rm -rf $(VENV) *.egg-info
