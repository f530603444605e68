"""Set-up shared by the in-process page tests (Streamlit AppTest); test code, so `moeviz` stays free of
Streamlit."""

from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

REPO = Path(__file__).resolve().parents[1]
APP_DIR = REPO / "app"
APP = APP_DIR / "streamlit_app.py"


def app_test_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment of an in-process page test: offline, no folder limits and no default model set,
    and `app/` importable as under `streamlit run` (see `app_importable`)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name in ("MOEVIZ_MODEL_DIRS", "MOEVIZ_DEFAULT_MODEL", "MOEVIZ_STORE_DIRS"):
        monkeypatch.delenv(name, raising=False)
    app_importable(monkeypatch)


def app_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Put `app/` on `sys.path` as `streamlit run app/streamlit_app.py` does, so that the app's building
    blocks import as the pages import them (`from components import caches`)."""
    monkeypatch.syspath_prepend(str(APP_DIR))


def run_page(page: str, timeout_s: float = 60, **state) -> AppTest:
    """Run the app's `page` (Streamlit AppTest) with `state` set in its session first; asserts that it
    raised no exception and showed no error."""
    at = AppTest.from_file(str(APP), default_timeout=timeout_s)
    for key, value in state.items():
        at.session_state[key] = value
    at.switch_page(page).run()
    assert not at.exception, [e.value for e in at.exception]
    errors = [e.value for e in at.error]
    assert not errors, errors
    return at
