"""Checkpoints and Compare say when two models are not one training run (expert ids do not correspond) and
draw no agreement across such a pair; the Checkpoints page renders its controls before it traces, and
reports each checkpoint traced (Streamlit AppTest; the browser's view of both:
tests/browser/test_app_browser_lineage.py)."""

from __future__ import annotations

import shutil

import pytest
from streamlit.testing.v1 import AppTest

from moeviz.models.loading import sample_models_dir
from tests.support.app import app_test_env, run_page

LOCAL_FOLDER = "Local folder…"  # components.access.LOCAL_FOLDER


@pytest.fixture(autouse=True)
def _app_env(monkeypatch):
    app_test_env(monkeypatch)


def chart_data(at: AppTest, title: str) -> list[dict]:
    import pyarrow as pa

    (chart,) = [c for c in at.get("vega_lite_chart") if title in c.proto.spec]
    (dataset,) = chart.proto.datasets
    return pa.ipc.open_stream(dataset.data.data).read_all().to_pylist()


def element_types(node) -> list[str]:
    """Element types of the main area, in page order (depth first)."""
    types = [getattr(node, "type", "")]
    for child in getattr(node, "children", {}).values():
        types += element_types(child)
    return types


def lineage_warnings(at: AppTest) -> list[str]:
    return [w.value for w in at.warning if "not one training run" in w.value.lower()]


def test_checkpoints_renders_its_controls_first_and_reports_each_checkpoint() -> None:
    at = run_page("pages/checkpoints.py", timeout_s=300)
    assert at.radio(key="saturation_kind").value == "topk"
    assert at.selectbox(key="timeline_indicator").value == "load_entropy"
    types = element_types(at.main)
    # the controls come before the tracing progress and before every chart
    assert types.index("radio") < types.index("status") < types.index("vega_lite_chart")
    lines = [m.value for m in at.markdown]
    for i, step in enumerate(["step-00000", "step-00010", "step-01000"]):
        index = [0, 1, 7][i]
        assert f"Traced checkpoint {step} ({index + 1}/8)" in lines
    assert not lineage_warnings(at)  # the bundled series is one run
    assert {row["checkpoint"] for row in chart_data(at, "Router saturation")} >= {"step-00000", "step-01000"}


def test_checkpoints_warns_about_an_unrelated_checkpoint_and_does_not_draw_across_it(tmp_path) -> None:
    series = tmp_path / "mixed-series"
    for name in ("step-00000", "step-00010"):
        shutil.copytree(sample_models_dir() / "mixtral-healthy-series" / name, series / name)
    shutil.copytree(sample_models_dir() / "mixtral-collapsed", series / "step-00020")  # another run
    at = run_page(
        "pages/checkpoints.py", timeout_s=300, series_choice=LOCAL_FOLDER, series_folder=str(series)
    )
    (warning,) = lineage_warnings(at)
    assert "step-00010 → step-00020" in warning and "cosine" in warning
    assert "step-00000 → step-00010" not in warning
    # saturation is against the final checkpoint: only from the break on
    assert {row["checkpoint"] for row in chart_data(at, "Router saturation")} == {"step-00020"}
    drift = {row["checkpoint"] for row in chart_data(at, "Expert drift")}
    assert "step-00020" not in drift and "step-00010" in drift


def test_compare_warns_above_the_agreement_for_unrelated_models_only() -> None:
    at = run_page(
        "pages/compare.py", compare_a="sample:mixtral-healthy", compare_b="sample:mixtral-collapsed"
    )
    (warning,) = lineage_warnings(at)
    assert "expert ids" in warning.lower() and "load balance" in warning
    types = element_types(at.main)
    alert = next(i for i, t in enumerate(types) if t in ("warning", "alert"))
    assert alert < types.index("vega_lite_chart")  # above every view
    related = run_page(
        "pages/compare.py",
        compare_a="sample:mixtral-healthy-series/step-00100",
        compare_b="sample:mixtral-healthy-series/step-01000",
    )
    assert not lineage_warnings(related)
