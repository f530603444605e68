"""Shareable state (`components.share`): a link's model, layer, token, expert and Learn step are restored, a
bad one ignored with a toast naming it; a changed widget updates the URL; and the "Reproduce in Python" code
of a page, run as printed, gives the numbers that page shows."""

from __future__ import annotations

import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from tests.support.app import APP, app_test_env, open_snippets

MODEL = "sample:mixtral-unbalanced"


@pytest.fixture(autouse=True)
def _app_env(monkeypatch):
    app_test_env(monkeypatch)


def open_link(page: str, **params) -> AppTest:
    """The app opened on `page` with the URL's query `params` (as a shared link opens it)."""
    at = AppTest.from_file(str(APP), default_timeout=120)
    at.query_params.update(params)
    at.switch_page(page).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def reproduced(at: AppTest) -> dict:
    """Run the page's "Reproduce in Python" code as printed; → its names."""
    [code] = [c.value for c in open_snippets(at).code]
    namespace: dict = {}
    exec(compile(code, "<snippet>", "exec"), namespace)
    return namespace


def test_a_link_restores_model_layer_token_and_expert_and_widgets_update_it():
    at = open_link("pages/structure.py", model=MODEL, layer="2", expert="5")
    assert at.session_state["model"] == MODEL
    assert at.sidebar.selectbox(key="model_choice").value == MODEL
    assert at.select_slider(key="layer_widget").value == "2"
    assert at.session_state["expert"] == 5  # chosen by the link: no default moves it
    assert at.query_params["layer"] == ["2"] or at.query_params["layer"] == "2"
    at.select_slider(key="layer_widget").set_value("1").run()  # a widget changed: the URL follows
    assert str(at.query_params["layer"]).strip("[]'") == "1"
    assert at.select_slider(key="layer_widget").value == "1"  # and the link's old value does not undo it
    assert not at.toast


def test_a_links_token_opens_the_why_page_on_it():
    at = open_link("pages/why.py", model=MODEL, token="3", layer="1")
    label = at.session_state["token"]
    assert label.startswith("3:"), label
    assert str(at.query_params["token"]).strip("[]'") == "3"


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"model": "/etc"}, "model='/etc'"),
        ({"model": "sample:nope"}, "model='sample:nope'"),
        ({"layer": "99"}, "layer='99'"),
        ({"expert": "4096"}, "expert='4096'"),
        ({"expert": "x"}, "expert='x'"),
    ],
)
def test_bad_link_values_are_ignored_with_a_toast(monkeypatch, tmp_path, params, named):
    monkeypatch.setenv("MOEVIZ_MODEL_DIRS", str(tmp_path))  # /etc lies outside the folders allowed
    at = open_link("pages/structure.py", **params)
    assert not at.error
    assert any(named in toast.value for toast in at.toast), [t.value for t in at.toast]
    assert at.session_state["model"] == "sample:mixtral-healthy"  # the default, untouched


def test_a_learn_link_opens_its_step_and_its_snippet_gives_the_steps_numbers():
    at = open_link("pages/learn.py", step="bias")
    assert at.session_state["learn_step"] == "bias"
    names = reproduced(at)
    shown = next(m.value for m in at.metric if m.label == "Tokens that change experts")
    assert shown.startswith(f"{names['changed']} of ")
    at.button(key="learn_next").click().run()  # next step: the URL follows
    assert str(at.query_params["step"]).strip("[]'") == "shared"
    bad = open_link("pages/learn.py", step="nope")
    assert any("step='nope'" in toast.value for toast in bad.toast)


def test_the_load_pages_snippet_gives_its_tables():
    at = open_link("pages/load.py", model=MODEL)
    names = reproduced(at)
    balance = at.dataframe[0].value  # "Balance per layer", the first table
    pd.testing.assert_frame_equal(
        names["balance"].reset_index(drop=True), balance.reset_index(drop=True), check_dtype=False
    )
    assert names["report"].verdict.name.lower() in "".join(m.value for m in at.markdown)
