"""Fixtures and readers shared by the Learn page's AppTests (tests/app/test_app_learn*.py): import the
fixtures into a test module's namespace to use them."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

import moeviz
from tests.support.app import app_importable, app_test_env

PAGE = "pages/learn.py"
HEALTHY, BIASED = "sample:mixtral-healthy", "sample:deepseek-v3-bias"


@pytest.fixture(autouse=True)
def _app_env(monkeypatch):
    app_test_env(monkeypatch)


@pytest.fixture(scope="module")
def ui():
    """`components.learn` (the lesson text, samples and sweep), imported as the page imports it."""
    with pytest.MonkeyPatch.context() as mp:
        app_importable(mp)
        from components import learn

        return learn


@pytest.fixture(scope="module")
def traces(ui):
    """The lesson text routed through each sample, captured here (not through the app)."""
    sources = {HEALTHY, BIASED, *ui.COLLAPSE_SAMPLES.values()}
    return {source: moeviz.capture(moeviz.load_model(source), ui.LESSON_TEXT) for source in sources}


def chart_rows(at: AppTest, title: str) -> pd.DataFrame:
    """The rows of the one chart whose spec contains `title` (its first dataset, shipped as Arrow)."""
    import pyarrow as pa

    specs = [(c, json.dumps(json.loads(c.proto.spec), ensure_ascii=False)) for c in at.get("vega_lite_chart")]
    (chart,) = [c for c, spec in specs if title in spec]
    return pa.ipc.open_stream(chart.proto.datasets[0].data.data).read_all().to_pandas()
