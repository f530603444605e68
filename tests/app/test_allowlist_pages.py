"""The allowed folders hold on the app's pages: the Checkpoints page checks each part of a
comma-separated series on its own, and the Corpus page refuses a store with a link outside. The checks
themselves: tests/models/test_hardening_allowlist.py."""

from __future__ import annotations

from streamlit.testing.v1 import AppTest

from tests.support.allowlist import allowlist_fixtures
from tests.support.app import APP

_app_env, roots, model_in = allowlist_fixtures()


def test_each_part_of_a_comma_series_is_checked(roots, model_in):
    """`ALLOWED/x,OUTSIDE/series/step-2` resolves, as one path, inside ALLOWED; split, it is not."""
    allowed, outside = roots
    model_in(allowed, "x")
    model_in(outside / "series", "step-2")
    text = f"{allowed}/x,{outside}/series/step-2"
    (allowed / f"x,{outside}" / "series" / "step-2").mkdir(parents=True)  # the joined path is a folder too
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.session_state["series_choice"] = "Local folder…"
    at.session_state["series_folder"] = text
    at.switch_page("pages/checkpoints.py").run()
    assert not at.exception, [e.value for e in at.exception]
    errors = [e.value for e in at.error]
    assert errors and "outside the model folders" in errors[0] and "step-2" in errors[0], errors


def test_the_corpus_page_refuses_a_store_with_a_link_outside(roots):
    allowed, outside = roots
    store = allowed / "store"
    store.mkdir()
    (store / "runs").symlink_to(outside, target_is_directory=True)
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.session_state["corpus_mode"] = "Open a store folder…"
    at.session_state["store_folder"] = str(store)
    at.switch_page("pages/corpus.py").run()
    assert not at.exception, [e.value for e in at.exception]
    errors = [e.value for e in at.error]
    assert errors and "outside the store folders" in errors[0] and "runs" in errors[0], errors


def test_an_allowlist_set_but_empty_opens_no_folder(roots, model_in, monkeypatch):
    allowed, _ = roots
    model_in(allowed, "x")
    monkeypatch.setenv("MOEVIZ_MODEL_DIRS", " ")  # set, naming no folder: none allowed (it was "any")
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.session_state["series_choice"] = "Local folder…"
    at.session_state["series_folder"] = str(allowed / "x")
    at.switch_page("pages/checkpoints.py").run()
    assert not at.exception, [e.value for e in at.exception]
    errors = [e.value for e in at.error]
    assert errors and "opens no local model folders (MOEVIZ_MODEL_DIRS is set but names none)" in errors[0]
