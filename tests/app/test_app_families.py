"""The app uses the family facts (Streamlit AppTest on tiny models opened as local folders): a LongCat-style
model's zero-computation experts are counted apart on About (with the share of slots they took, the
library's figure) and named by the layer picker; DeepSeek-V4's hash-routed layers are shown as such; the
dense layers are listed."""

from __future__ import annotations

import pytest

from tests.support.app import local_tiny_model, run_page


def _metric(at, label: str) -> str:
    (value,) = [m.value for m in at.metric if m.label == label]
    return value


def _facts(at):
    (facts,) = [d.value for d in at.dataframe if "selection" in d.value.columns]
    return facts


def test_about_counts_zero_computation_experts_apart(tiny_model_dir, monkeypatch):
    import moeviz
    from moeviz.analysis import balance_frame

    folder = local_tiny_model(tiny_model_dir, monkeypatch, "longcat_flash")
    at = run_page("pages/about.py", timeout_s=120)
    from components.prompt import EXAMPLE_PROMPT  # About has no prompt form: it shows the example's routing

    trace = moeviz.capture(moeviz.load_model(str(folder)), EXAMPLE_PROMPT)
    skipped = balance_frame(trace)["skipped_fraction"].mean()
    assert skipped > 0  # the case under test: some tokens chose an identity expert
    assert _metric(at, "Zero-computation experts") == f"4 · {skipped:.1%} of slots"
    assert _metric(at, "Routed experts") == "8"
    facts = _facts(at)
    assert facts["experts"].astype(int).eq(8).all() and facts["zero_experts"].astype(int).eq(4).all()
    # dead experts and balance count the 8 routed experts only
    assert balance_frame(trace)["experts"].eq(8).all()
    at = run_page("pages/routing.py", timeout_s=120)
    assert any("Experts 8–11 are zero-computation experts" in c.value for c in at.caption)


@pytest.mark.parametrize("family", ["deepseek_v4"])
def test_hash_routed_layers_are_shown_as_such(tiny_model_dir, monkeypatch, family):
    local_tiny_model(tiny_model_dir, monkeypatch, family)
    at = run_page("pages/about.py", timeout_s=120)
    facts = _facts(at)
    assert facts.loc[facts["layer"].astype(int) == 0, "selection"].tolist() == ["hash table"]
    assert set(facts.loc[facts["layer"].astype(int) > 0, "selection"]) == {"scores + bias"}
    assert set(facts["score_fn"]) == {"sqrtsoftplus"}
    at = run_page("pages/routing.py", timeout_s=120, layer="0")
    assert any("hash routing" in c.value for c in at.caption)


def test_about_lists_the_dense_layers(tiny_model_dir, monkeypatch):
    local_tiny_model(tiny_model_dir, monkeypatch, "deepseek_v3")  # first_k_dense_replace = 1
    at = run_page("pages/about.py", timeout_s=120)
    assert _metric(at, "Dense layers") == "0"


@pytest.mark.parametrize("page", ["pages/about.py", "pages/routing.py", "pages/load.py"])
def test_a_token_classifier_opens_on_the_routing_pages(tiny_model_dir, monkeypatch, page):
    local_tiny_model(tiny_model_dir, monkeypatch, "openai_privacy_filter")
    at = run_page(page, timeout_s=120)  # no exception, no error box
    assert at.title[0].value
