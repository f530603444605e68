"""The Routing page's interactions at scale (Streamlit AppTest, a synthetic DeepSeek-V3-shaped trace): a
sort of the expert axis, or a picked expert, changes the heatmaps' data alone, never their spec, so the
browser patches the new rows into the drawn charts (Streamlit keeps a Vega view whose spec, dataset names
aside, is unchanged) instead of compiling and drawing new ones; and the order the data carries is the
library's expert order, computed here apart from the app."""

from __future__ import annotations

import io
import json

import pandas as pd
import pyarrow as pa
import pytest

from moeviz.analysis import expert_balance_frame, layer_trace
from moeviz.analysis.expert_order import expert_order
from moeviz.charts.scale import ORDER_FIELD
from moeviz.testing.scale_traces import shaped_trace
from tests.support.app import app_test_env, run_page

PROMPT = "synthetic deepseek_v3 trace, routing interactions"
TOP_N = 32  # the expert axis's default top-N
HEATMAPS = ("Router scores, layer", "Dispatch over the whole input, layer")


@pytest.fixture(scope="module")
def trace():
    return shaped_trace("deepseek_v3", num_tokens=256)  # over the 64-token window: the binned overview too


@pytest.fixture
def viewed(trace, monkeypatch):
    """The app's capture of PROMPT is the synthetic trace (the sample stays the model)."""
    app_test_env(monkeypatch)
    from components import caches

    real = caches.captured

    def captured(source: str, text: str, progress=None):
        return trace if text == PROMPT else real(source, text, progress)

    monkeypatch.setattr(caches, "captured", captured)
    return trace


def _named_datasets_aside(node):
    """A spec with every dataset reference by name replaced by a placeholder (Streamlit names each dataset
    by a hash of its rows and compares specs without those names)."""
    if isinstance(node, dict):
        return {
            key: "<dataset>"
            if key == "data" and isinstance(value, dict) and "name" in value
            else _named_datasets_aside(value)
            for key, value in node.items()
            if key != "datasets"
        }
    if isinstance(node, list):
        return [_named_datasets_aside(value) for value in node]
    return node


def heatmaps(at) -> dict[str, tuple[dict, pd.DataFrame]]:
    """The page's two heatmaps by title: (spec without dataset names, its rows)."""
    out = {}
    for chart in at.get("arrow_vega_lite_chart") + at.get("vega_lite_chart"):
        for title in HEATMAPS:
            if title in chart.proto.spec:
                (dataset,) = chart.proto.datasets
                rows = pa.ipc.open_stream(io.BytesIO(dataset.data.data)).read_all().to_pandas()
                out[title] = (_named_datasets_aside(json.loads(chart.proto.spec)), rows)
    assert set(out) == set(HEATMAPS), list(out)
    return out


def experts_in_order(rows: pd.DataFrame) -> list[int]:
    """The experts of a heatmap's rows in the order its data gives them."""
    ranked = rows.groupby("expert")[ORDER_FIELD].min().sort_values(kind="stable")
    return [int(e) for e in ranked.index]


def test_sort_and_pick_change_only_the_heatmaps_data(viewed) -> None:
    trace = viewed
    at = run_page("pages/routing.py", timeout_s=300, model="sample:mixtral-healthy", prompt=PROMPT)
    first = trace.layers[0]
    load = expert_balance_frame(layer_trace(trace, first.layer))
    busiest = [int(e) for e in expert_order(load, by="load")[:TOP_N]]  # the chosen expert is the busiest
    before = heatmaps(at)
    for _, rows in before.values():
        assert experts_in_order(rows) == sorted(busiest)  # by id

    at.selectbox(key="expert_sort_widget").set_value("load").run()
    assert not at.exception, [e.value for e in at.exception]
    after = heatmaps(at)
    for title in HEATMAPS:
        assert after[title][0] == before[title][0], title  # the same spec: the browser keeps its chart
        assert experts_in_order(after[title][1]) == busiest  # busiest first

    quiet = int(expert_order(load, by="load")[-1])  # the least loaded: outside the top-N
    at.selectbox(key="expert_widget").set_value(quiet).run()
    assert not at.exception, [e.value for e in at.exception]
    picked = heatmaps(at)
    # the chosen expert joins the axis at its place by load (last); the rows' spec is that of 33 experts
    for title in HEATMAPS:
        assert experts_in_order(picked[title][1]) == [*busiest, quiet]
