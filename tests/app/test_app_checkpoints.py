"""The Checkpoints and Corpus pages on their defaults (Streamlit AppTest): the sample series and a sample
store, shown in full."""

from __future__ import annotations

import pytest
from streamlit.testing.v1 import AppTest

from tests.support.app import APP, app_test_env, run_page

TIMEOUT_S = 60


@pytest.fixture(autouse=True)
def _app_env(monkeypatch):
    app_test_env(monkeypatch)


def chart_rows(chart) -> list[dict]:
    import pyarrow as pa

    (dataset,) = chart.proto.datasets
    return pa.ipc.open_stream(dataset.data.data).read_all().to_pylist()


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
    # every checkpoint of the series, as the library resolves it, in the balance and specialisation views
    from moeviz.store.checkpoints import resolve_series

    _, checkpoints = resolve_series(at.selectbox(key="series_choice").value)
    labels = {label for label, _ in checkpoints}
    assert len(labels) == 8
    for title in ("Domain specialisation over training", "Router saturation"):
        (chart,) = [c for c in at.get("vega_lite_chart") if title in c.proto.spec]
        shown = {row["checkpoint"] for row in chart_rows(chart)}
        # saturation is against the final checkpoint: it is left out of its own comparison
        assert shown == labels or (title == "Router saturation" and shown == labels - {max(labels)}), (
            title,
            shown,
        )
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
