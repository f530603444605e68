"""The Checkpoints page on a fine-tune's series of PEFT adapters (Streamlit AppTest): a typed folder of
`checkpoint-<step>/` adapters shows a Base model picker, and the timeline runs over the base picked, with
the checkpoints the library resolves for that base (the base alone first)."""

from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from moeviz.models.loading import sample_models_dir
from tests.support.adapters import save_adapter_series
from tests.support.app import APP, app_test_env, run_page

LOCAL_FOLDER = "Local folder…"  # components.access.LOCAL_FOLDER
BASE = "sample:mixtral-healthy"


@pytest.fixture(autouse=True)
def _app_env(monkeypatch):
    app_test_env(monkeypatch)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """Adapters saved at steps 3 and 12 over the healthy sample, naming a base that is not here."""
    folder = tmp_path_factory.mktemp("finetune") / "run"
    save_adapter_series(
        folder, sample_models_dir() / "mixtral-healthy", [3, 12], declared_base="/gone/mixtral-healthy"
    )
    return folder


def chart_rows(chart) -> list[dict]:
    import pyarrow as pa

    (dataset,) = chart.proto.datasets
    return pa.ipc.open_stream(dataset.data.data).read_all().to_pylist()


def test_checkpoints_page_runs_on_an_adapter_series_with_a_base_picked(run) -> None:
    from moeviz.store.checkpoints import resolve_series

    at = run_page(
        "pages/checkpoints.py",
        timeout_s=180,
        series_choice=LOCAL_FOLDER,
        series_folder=str(run),
        series_base=BASE,
    )
    assert at.selectbox(key="series_base").value == BASE
    _, checkpoints = resolve_series(str(run.resolve()), BASE)
    labels = [label for label, _ in checkpoints]
    assert labels == ["base", "checkpoint-3", "checkpoint-12"]
    captions = " ".join(c.value for c in at.caption)
    assert "3 checkpoints (base … checkpoint-12)" in captions and f"adapters over {BASE}" in captions
    assert len(at.get("vega_lite_chart")) == 4  # saturation, balance, drift, specialisation
    (chart,) = [c for c in at.get("vega_lite_chart") if "Domain specialisation over training" in c.proto.spec]
    assert {row["checkpoint"] for row in chart_rows(chart)} == set(labels)
    assert not at.warning  # adapters over one base keep its expert ids: no lineage break


def test_the_base_model_picker_offers_the_declared_base_by_name_and_checks_a_typed_folder(
    run, monkeypatch, tmp_path
) -> None:
    monkeypatch.setenv("MOEVIZ_MODEL_DIRS", str(run.resolve().parent))  # the series, not the base below
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.session_state["series_choice"] = LOCAL_FOLDER
    at.session_state["series_folder"] = str(run)
    at.session_state["series_base"] = LOCAL_FOLDER
    at.session_state["series_base_folder"] = str(tmp_path)
    at.switch_page("pages/checkpoints.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert "outside" in at.error[0].value and not at.get("vega_lite_chart")
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.session_state["series_choice"] = LOCAL_FOLDER
    at.session_state["series_folder"] = str(run)
    at.switch_page("pages/checkpoints.py").run(timeout=180)
    # the sample whose name the declared base (/gone/mixtral-healthy) ends with is offered first
    assert at.selectbox(key="series_base").value == BASE
