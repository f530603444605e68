"""The suite's tiers and shared fixtures.

Tiers are folders, and each test gets its folder's marker here (so `-m unit` and `make test-fast` select by
what a test needs, not by what its author remembered to mark):
- tests/unit: no model (analysis, charts, what-ifs, codecs, the store schema, Streamlit-free components);
- tests/models: tiny random and bundled sample models in-process (capture, families, the oracle,
  attention, interventions, loading, the store, the CLI through `moeviz.cli.main`);
- tests/app: the app's pages in-process (Streamlit AppTest);
- tests/browser: the app served and driven in headless Chromium;
- tests/system: real subprocesses (signals, exit codes, the wheel, Ray, vLLM, the sample recipe).
Shared helpers live in tests/support; no test module imports another.

Fixtures: tiny random models of every family saved to disk, the bundled sample, a small corpus, Chromium.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# One OpenMP thread per test process (set before torch is imported; an explicit OMP_NUM_THREADS wins): the
# models here are tiny, and torch's intra-op pool spins on the cores it may use, so on a 2-core machine a
# second thread (worse: one per core in each of `-n 2`'s workers) made the models tier ~3× slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Nothing kept on disk between tests (`moeviz.trace.kept`): a test that captures the example prompt would
# otherwise find the routing an earlier test (or the developer's app) kept, and skip the capture it tests.
# The tests of keeping set their own folder.
os.environ["MOEVIZ_CACHE_DIR"] = ""

REPO = Path(__file__).resolve().parents[1]
TIERS = ("unit", "models", "app", "browser", "system")


def pytest_collection_modifyitems(config, items) -> None:
    """Mark each test with its tier (the first folder under tests/)."""
    root = Path(__file__).parent
    for item in items:
        parts = Path(item.path).resolve().relative_to(root).parts
        if len(parts) > 1 and parts[0] in TIERS:
            item.add_marker(getattr(pytest.mark, parts[0]))


@pytest.hookimpl(optionalhook=True, tryfirst=True)  # before xdist's own (the first answer is taken)
def pytest_xdist_make_scheduler(config, log):
    """`-n N --dist loadgroup`, scheduled here: pytest-xdist 3.8 puts a test in its xdist_group by rewriting
    `item._nodeid`, which pytest 9 no longer reads, so its loadgroup ignores the marks (it is plain `load`).
    Here each test file is one unit of work, so that a module-scoped fixture (a sample model's measurement, a
    Ray cluster) is built once, not on both workers; all of tests/browser is one (an app server per model)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FilesAndBrowser(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "tests/browser" if path.startswith("tests/browser/") else path

    return FilesAndBrowser(config, log)


def _check_tiers(config, paths) -> None:
    """Each tier folder named on the command line (`make test-fast`: tests/unit tests/models) must hold tests:
    pytest's exit 5 ("no tests collected") only catches all of them being empty, and a tier that ran nothing
    would pass silently. Exit 5 here too. (Not when -k, -m or --deselect chose the tests.)"""
    if any(config.getoption(name, None) for name in ("keyword", "markexpr", "deselect")):
        return
    root = Path(__file__).parent
    named = {(config.invocation_params.dir / arg.split("::")[0]).resolve() for arg in config.args}
    resolved = [path.resolve() for path in paths]
    found = {path.relative_to(root).parts[0] for path in resolved if path.is_relative_to(root)}
    empty = [f"tests/{tier}" for tier in TIERS if root / tier in named and tier not in found]
    if empty:
        pytest.exit(f"no tests collected in {', '.join(empty)}: a tier ran nothing", returncode=5)


def pytest_collection_finish(session) -> None:
    if not hasattr(session.config, "workerinput"):  # a plain run (under xdist: the controller checks)
        _check_tiers(session.config, [Path(item.path) for item in session.items])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids) -> None:
    """The xdist controller: the tests a worker collected (every worker collects them all)."""
    _check_tiers(node.config, [node.config.rootpath / nodeid.split("::")[0] for nodeid in ids])


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """`tiny_model_dir(family, **overrides)` -> folder of a saved tiny model (built once per session)."""
    from moeviz.testing.tiny_models import save_tiny_model

    cache: dict[tuple, Path] = {}

    def make(family: str, **overrides) -> Path:
        key = (family, tuple(sorted(overrides.items())))
        if key not in cache:
            folder = tmp_path_factory.mktemp(family.replace("-", "_"))
            cache[key] = save_tiny_model(family, folder, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def sample_model():
    import moeviz

    return moeviz.load_model("sample:mixtral-healthy")


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A small corpus folder for the store tests: two domains, three documents each (1,500 characters of
    the sample evaluation slices), a few batches of ≤ 4 × 96 tokens."""
    from moeviz.samples import eval_dir

    root = tmp_path_factory.mktemp("corpus")
    for domain in ("python", "bible_en"):
        text = (eval_dir() / f"{domain}.txt").read_text(encoding="utf-8")
        (root / domain).mkdir()
        for i in range(3):
            (root / domain / f"doc{i}.txt").write_text(text[i * 1500 : (i + 1) * 1500], encoding="utf-8")
    return root


@pytest.fixture(scope="session")
def browser():
    """Debian's headless Chromium, one for every browser test of the session (or of an xdist worker); each
    test opens its own pages or contexts (own sessions of the app). A missing browser fails the test: in CI
    the browser tests must run, never skip."""
    from playwright.sync_api import sync_playwright

    from tests.support.server import CHROMIUM, CHROMIUM_ARGS

    if not CHROMIUM.is_file():
        pytest.fail(f"{CHROMIUM} not found: the browser tests need Debian's chromium (apt-get install it)")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture(scope="session")
def app_url():
    """`app_url(model)` -> the URL of the checkout's app served with `model` as its default (`streamlit run`,
    tests/support/server.py): started on first use, then shared by every browser test of the session that
    asks for that model, and stopped at the session's end. Under `-n N --dist loadgroup` all of tests/browser
    runs on one worker (`pytest_xdist_make_scheduler` above), so there is one server per model in all."""
    from contextlib import ExitStack

    from tests.support.server import AppDidNotStart, running_app

    urls: dict[str, str] = {}
    with ExitStack() as servers:

        def serve(model: str) -> str:
            if model not in urls:
                try:
                    urls[model] = servers.enter_context(running_app(model))
                except AppDidNotStart as exc:
                    pytest.fail(str(exc))
            return urls[model]

        yield serve


# ---- a test run writes no tracked file ------------------------------------------------------------------
def pytest_sessionstart(session) -> None:
    if not hasattr(session.config, "workerinput"):  # the controller (or a plain run), not an xdist worker
        from tests.support.git_tree import tracked_state

        session.config.stash[_TRACKED] = tracked_state(REPO)


def pytest_sessionfinish(session, exitstatus) -> None:
    """Fail the run when it changed a tracked file (a screenshot, a doc), also one already modified before
    the run (its content is compared, tests/support/git_tree.py): tests write to tmp or an output folder;
    README pictures come from `make screenshots`."""
    from tests.support.git_tree import change_line, changed_files, tracked_state

    before = session.config.stash.get(_TRACKED, None)
    if before is None or hasattr(session.config, "workerinput"):
        return
    after = tracked_state(REPO)
    if after is None:
        return
    changed = changed_files(before, after)
    if os.environ.get("MOEVIZ_SCREENSHOTS"):  # `make screenshots`: rewriting the README pictures is the point
        shots = Path(os.environ["MOEVIZ_SCREENSHOTS"]).resolve()
        changed = [path for path in changed if not (REPO / path).resolve().is_relative_to(shots)]
    if changed:
        session.config.get_terminal_writer().line(
            "the test run changed tracked files (tests must not write into the checkout):\n  "
            + "\n  ".join(change_line(path, before, after) for path in changed),
            red=True,
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


_TRACKED = pytest.StashKey[dict[str, str] | None]()
