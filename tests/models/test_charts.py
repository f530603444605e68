"""The routing charts carry exactly the trace's routing, windowed, and render with Vega-Lite."""

from __future__ import annotations

import re

import numpy as np
import pandas as pd
import pytest

import moeviz
from moeviz.analysis import expert_balance_frame
from moeviz.charts import expert_load_chart, router_score_heatmap, token_label, token_window
from tests.support.charts import PROMPT, data_of


@pytest.fixture(scope="module")
def trace(sample_model) -> moeviz.Trace:
    return moeviz.capture(sample_model, PROMPT)


def chart_data(chart) -> pd.DataFrame:
    return data_of(chart.to_dict())


def dispatched_pairs(
    routing: moeviz.LayerRouting, lo: int = 0, hi: int | None = None
) -> set[tuple[int, int]]:
    rows, slots = np.nonzero(routing.experts >= 0)
    hi = len(routing.token_rows) if hi is None else hi
    return {(int(r), int(routing.experts[r, s])) for r, s in zip(rows, slots, strict=True) if lo <= r < hi}


def test_heatmap_has_one_cell_per_token_and_expert_and_marks_the_dispatch(trace):
    assert len(trace.layer_keys) == 4
    for site, layer in trace.layer_keys:
        routing = trace.layer(layer, site)
        data = chart_data(router_score_heatmap(trace.scores_frame(layer, site)))
        n, e = routing.logits.shape
        assert len(data) == n * e
        assert set(zip(data["row"], data["expert"], strict=True)) == {
            (r, x) for r in range(n) for x in range(e)
        }
        marked = data[data["dispatched"]]
        assert set(zip(marked["row"], marked["expert"], strict=True)) == dispatched_pairs(routing)
        # scores and weights are the trace's own
        cell = data.set_index(["row", "expert"])
        np.testing.assert_allclose(cell["score"].unstack().to_numpy(), routing.scores, rtol=1e-6, atol=1e-7)
        weights = np.zeros((n, e))
        for r, x in dispatched_pairs(routing):
            weights[r, x] = routing.weights[r, list(routing.experts[r]).index(x)]
        np.testing.assert_allclose(cell["weight"].unstack().to_numpy(), weights, rtol=1e-6)


def test_heatmap_labels_keep_repeated_tokens_apart(trace):
    data = chart_data(router_score_heatmap(trace.scores_frame(0)))
    tokens = trace.tokens
    assert tokens["token"].duplicated().any(), "the prompt should repeat a token (' a')"
    labels = data.drop_duplicates("row").sort_values("row")["label"].tolist()
    assert labels == [token_label(p, t) for p, t in zip(tokens["pos"], tokens["token"], strict=True)]
    assert len(set(labels)) == len(tokens)
    assert token_label(3, " a\n") == "3:␣a↵"
    assert token_label(3, "a", seq=1) == "1/3:a"


def test_heatmap_windows_long_inputs(trace):
    routing = trace.layer(1)
    n, e = routing.logits.shape
    data = chart_data(router_score_heatmap(trace.scores_frame(1), max_tokens=7, start=5))
    assert sorted(data["row"].unique()) == list(range(5, 12))
    assert len(data) == 7 * e
    marked = data[data["dispatched"]]
    assert set(zip(marked["row"], marked["expert"], strict=True)) == dispatched_pairs(routing, 5, 12)
    # a start past the end still shows a full window, the last one
    late = chart_data(router_score_heatmap(trace.scores_frame(1), max_tokens=7, start=10_000))
    assert sorted(late["row"].unique()) == list(range(n - 7, n))
    assert token_window(n, max_tokens=400, start=3) == (0, n)
    assert token_window(1000, max_tokens=400, start=-5) == (0, 400)
    with pytest.raises(ValueError):
        token_window(10, max_tokens=0)


def test_heatmap_subtitle_names_the_window(trace):
    spec = router_score_heatmap(trace.scores_frame(0), max_tokens=10, start=4).to_dict()
    n = len(trace.layer(0).token_rows)
    assert spec["title"]["subtitle"] == f"tokens 4–13 of {n}"


def test_load_chart_counts_are_the_dispatch_counts(trace):
    load = expert_balance_frame(trace)
    for site, layer in trace.layer_keys:
        routing = trace.layer(layer, site)
        data = chart_data(expert_load_chart(load[(load["layer"] == layer) & (load["site"] == site)]))
        experts = routing.experts[routing.experts >= 0]
        expected = np.bincount(experts, minlength=routing.num_experts)
        assert data.sort_values("expert")["count"].tolist() == expected.tolist()
        assert data["share"].sum() == pytest.approx(1.0)


def test_charts_render_one_mark_per_cell(trace):
    vl_convert = pytest.importorskip("vl_convert")
    routing = trace.layer(2)
    n, e = routing.logits.shape
    svg = vl_convert.vegalite_to_svg(router_score_heatmap(trace.scores_frame(2)).to_dict())
    assert len(re.findall(r'aria-roledescription="rect mark"', svg)) == n * e
    assert len(re.findall(r'aria-roledescription="text mark"', svg)) == len(dispatched_pairs(routing))
    load = expert_balance_frame(trace).query("layer == 2")
    svg = vl_convert.vegalite_to_svg(expert_load_chart(load).to_dict())
    bars = re.findall(r'aria-label="expert: (\d+); tokens dispatched: (\d+);', svg)
    expected = np.bincount(routing.experts[routing.experts >= 0], minlength=e)
    assert sorted((int(x), int(c)) for x, c in bars) == list(enumerate(expected.tolist()))
    assert len(re.findall(r'aria-roledescription="rule mark"', svg)) == 1


def test_load_chart_bands_are_the_bootstrap_bands_in_tokens(trace):
    from moeviz.analysis.null import expert_confidence_frame

    load = expert_balance_frame(trace).query("layer == 1")
    bands = expert_confidence_frame(trace).query("layer == 1")
    data = chart_data(expert_load_chart(load, bands=bands)).sort_values("expert")
    routing = trace.layer(1)
    slots = len(routing.experts) * routing.k
    assert data["count_low"].to_numpy() == pytest.approx(bands["share_low"].to_numpy() * slots)
    assert data["count_high"].to_numpy() == pytest.approx(bands["share_high"].to_numpy() * slots)
    assert (data["count_low"] <= data["count"] + 1e-9).all() and (
        data["count"] <= data["count_high"] + 1e-9
    ).all()
    assert "count_low" not in chart_data(expert_load_chart(load)).columns  # no bands asked, none drawn
