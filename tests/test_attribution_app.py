"""The "Why this expert?" page: explain, what-if and importance run in the app on both sample families."""

from __future__ import annotations

import pytest
from streamlit.testing.v1 import AppTest

from tests.app_helpers import APP, app_test_env


@pytest.fixture(autouse=True)
def _app_env(monkeypatch):
    app_test_env(monkeypatch)


def _ok(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]


@pytest.mark.parametrize("model", ["sample:mixtral-healthy", "sample:deepseek-v3-bias"])
def test_why_page_explains_and_runs_what_if(model):
    at = AppTest.from_file(str(APP), default_timeout=90)
    at.session_state["model"] = model
    at.switch_page("pages/why.py").run()
    _ok(at)
    at.button(key="why_explain").click().run()  # Explain
    _ok(at)
    assert any("IG convergence delta" in m.label for m in at.metric)
    at.radio(key="why_kind").set_value("Replace the top choice by the next-best").run()
    at.button(key="why_whatif").click().run()  # Run what-if
    _ok(at)
    assert any("log p(" in m.label for m in at.metric)
    at.button(key="why_importance_run").click().run()  # importance
    _ok(at)


def test_why_page_declines_prompts_over_its_limit():
    import moeviz

    loaded = moeviz.load_model("sample:mixtral-healthy")
    ids = list(range(3, 203)) * 11  # 2,200 tokens
    text = loaded.tokenizer.decode(ids)
    n = len(moeviz.capture(loaded, text).tokens)
    at = AppTest.from_file(str(APP), default_timeout=90)
    at.session_state["model"] = "sample:mixtral-healthy"
    at.session_state["prompt"] = text
    at.switch_page("pages/why.py").run()
    _ok(at)
    assert n > 2048
    assert any(f"has {n:,}" in i.value for i in at.info)
    assert [b.key for b in at.button if b.key.startswith("why_")] == []  # nothing to run
