# The two commands (see README): `make app` starts the app, `make test` runs the whole suite.
# Both do all setup on a fresh machine: a venv with the pinned CPU torch, the package, and (for tests)
# Debian's chromium for the browser tests.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.moeviz-installed
export HF_HUB_OFFLINE := 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: setup app run test lint bench chromium samples

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

test: setup chromium
	$(VENV)/bin/ruff check moeviz app tests scripts benchmarks
	$(VENV)/bin/ruff format --check moeviz app tests scripts benchmarks
	$(VENV)/bin/lint-imports
	PYTHONPATH=app $(VENV)/bin/lint-imports app/import-contracts.toml
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check --fix moeviz app tests scripts benchmarks
	$(VENV)/bin/ruff format moeviz app tests scripts benchmarks

bench: setup
	$(PY) benchmarks/bench_capture_overhead.py
	$(PY) benchmarks/bench_analysis.py
