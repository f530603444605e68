"""The Checkpoints and Corpus pages render without exceptions on their defaults (Streamlit AppTest)."""

from __future__ import annotations

import pytest
from streamlit.testing.v1 import AppTest

from tests.app_helpers import APP, app_test_env, run_page

TIMEOUT_S = 60


@pytest.fixture(autouse=True)
def _app_env(monkeypatch):
    app_test_env(monkeypatch)


def chart_titles(at: AppTest) -> list[str]:
    return [c.proto.spec for c in at.get("vega_lite_chart")]


def test_checkpoints_page_renders_the_sample_series() -> None:
    at = run_page("pages/checkpoints.py")
    assert at.title[0].value == "Checkpoints"
    assert at.selectbox(key="series_choice").value.endswith("mixtral-healthy-series")
    specs = chart_titles(at)
    assert len(specs) == 4  # saturation, balance, drift, specialisation
    assert any("Router saturation" in s for s in specs)
    assert any("Domain specialisation over training" in s for s in specs)
    assert "8 checkpoints" in " ".join(c.value for c in at.caption)
    names = {b.label for b in at.get("download_button")}
    assert {"checkpoint_timeline.csv", "checkpoint_timeline.parquet"} <= names


def test_corpus_page_builds_and_queries_a_sample_store() -> None:
    at = run_page("pages/corpus.py", model="sample:mixtral-healthy")
    assert at.title[0].value == "Corpus"
    assert len(at.get("vega_lite_chart")) == 3  # load, balance, specialisation
    at.multiselect(key="corpus_layers").set_value([1]).run()
    assert not at.exception, [e.value for e in at.exception]
    (load,) = [d for d in at.dataframe if "verdict" in d.value.columns]
    assert set(load.value["layer"]) == {1}


def test_corpus_page_refuses_a_store_outside_the_allowed_roots(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("MOEVIZ_STORE_DIRS", str(tmp_path / "allowed"))
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT_S)
    at.session_state["corpus_mode"] = "Open a store folder…"
    at.session_state["store_folder"] = str(tmp_path / "elsewhere")
    at.switch_page("pages/corpus.py").run()
    assert not at.exception
    assert "outside the store folders" in at.error[0].value
