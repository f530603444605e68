# The two commands (see README): `make app` starts the app, `make test` runs the whole suite.
# Both do all setup on a fresh machine: a venv with the pinned CPU torch, the package, and (for tests)
# Debian's chromium for the browser tests.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.moeviz-installed
export HF_HUB_OFFLINE := 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: setup app run test test-fast test-random lint bench chromium samples screenshots

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# torch first and pinned: the CPU wheel; an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,ray]'
	touch $(STAMP)

chromium:
	@command -v chromium >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	  else echo "browser tests need Debian's chromium: sudo apt-get install chromium" >&2; exit 1; fi; }

app: setup
	$(VENV)/bin/moeviz app

run: app

# Rebuild the sample models from scratch (~25 min on 2 cores; not part of the tests).
samples: setup
	$(PY) scripts/samples/build_corpus.py
	$(PY) scripts/samples/train_tokenizer.py
	$(PY) scripts/samples/train_all.py

# pytest over both cores (pytest-xdist); `loadgroup` is scheduled by tests/conftest.py: one test file per unit
# of work, all of tests/browser on one worker (one app server per model).
# PYTEST_ARGS: more options, e.g. `make test-fast PYTEST_ARGS=-x` or `PYTEST_ARGS=--randomly-seed=N`.
XDIST       ?= -n 2 --dist loadgroup
PYTEST_ARGS ?=

# Everything: lint, the import contracts, then every tier (tests/unit, models, app, browser, system).
test: setup chromium
	$(VENV)/bin/ruff check moeviz app tests scripts benchmarks
	$(VENV)/bin/ruff format --check moeviz app tests scripts benchmarks
	$(VENV)/bin/lint-imports
	PYTHONPATH=app $(VENV)/bin/lint-imports app/import-contracts.toml
	$(PY) -m pytest -q $(XDIST) --durations=30 $(PYTEST_ARGS)

# The tiers without the app, a browser or a real process (tests/unit, tests/models): under 3 min on 2 cores.
# A tier folder that collects no test fails the run (exit 5, tests/conftest.py).
test-fast: setup
	$(PY) -m pytest -q $(XDIST) --durations=10 $(PYTEST_ARGS) tests/unit tests/models

# The whole suite in a shuffled order (pytest-randomly; the default order is fixed by `-p no:randomly` in
# pyproject.toml). Its header says the seed (no -q); `make test-random PYTEST_ARGS=--randomly-seed=N` reruns
# that order.
test-random: setup chromium
	$(PY) -m pytest -p randomly $(XDIST) $(PYTEST_ARGS)

# The README's pictures (docs/screenshots/*.png): the browser tests, writing their screenshots there instead of
# test-output/screenshots. The tests that compare a page with its picture then compare it with itself; commit
# the pictures that changed (a test run never writes docs/: tests/conftest.py fails a run that does).
screenshots: setup chromium
	MOEVIZ_SCREENSHOTS=docs/screenshots $(PY) -m pytest -q $(XDIST) tests/browser

lint: setup
	$(VENV)/bin/ruff check --fix moeviz app tests scripts benchmarks
	$(VENV)/bin/ruff format moeviz app tests scripts benchmarks

bench: setup
	$(PY) benchmarks/bench_capture_overhead.py
	$(PY) benchmarks/bench_analysis.py
