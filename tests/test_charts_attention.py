"""Vega-Lite specs of the attention charts: what they encode, the data they carry, no-map layers, windows."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

import moeviz
from moeviz.charts import (
    HEAD_METRICS,
    HEAD_SELECTION,
    attention_block_frame,
    attention_map_chart,
    attention_row_chart,
    attention_row_frame,
    head_grid_frame,
    head_metric_heatmap,
    kv_whatif_heatmap,
)
from moeviz.whatif.kv_cache import kv_cache_whatif
from tests.chart_helpers import PROMPT, data_of


@pytest.fixture(scope="module")
def att_trace(sample_model) -> moeviz.Trace:
    return moeviz.capture(sample_model, PROMPT, attention=True)


@pytest.mark.parametrize("metric", list(HEAD_METRICS))
def test_head_heatmap_has_one_cell_per_layer_and_head(att_trace, metric):
    heads = att_trace.attention.head_summary(8)
    spec = head_metric_heatmap(heads, metric).to_dict()
    data = data_of(spec)
    assert len(data) == 4 * 4
    assert sorted(zip(data["layer"], data["head"], strict=True)) == [
        (lay, h) for lay in range(4) for h in range(4)
    ]
    np.testing.assert_allclose(data["value"], heads.sort_values(["layer", "head"])[metric])
    cells, text = spec["layer"]
    assert cells["mark"]["type"] == "rect"
    assert cells["encoding"]["x"]["field"] == "head" and cells["encoding"]["y"]["field"] == "layer"
    assert cells["encoding"]["color"]["condition"]["value"] == "#d9d9d9"  # no-map layers are grey
    (param,) = spec["params"]  # altair lifts a layer's selection to the top level
    assert param["name"] == HEAD_SELECTION and param["select"]["fields"] == ["layer", "head"]
    assert text["encoding"]["text"]["field"] == "mark"
    assert set(data["mark"]) <= {"S", "L", "G"}


def test_layers_without_a_map_fill_their_row_with_the_reason():
    heads = pd.DataFrame(
        {
            "layer": [0, 0, 1, 2, 2],
            "head": [0, 1, -1, 0, 1],
            "mean_entropy": [1.0, 2.0, np.nan, 0.5, 0.1],
            "mean_mean_distance": [1.0, 2.0, np.nan, 3.0, 4.0],
            "mean_sink_mass": [0.9, 0.1, np.nan, 0.2, 0.0],
            "mean_local_mass": [0.0, 0.6, np.nan, 0.1, 0.2],
            "kind": ["sink", "local", "no map", "global", "global"],
            "reason": ["", "", "Mamba layer: fixed-size state", "", ""],
        }
    )
    grid = head_grid_frame(heads)
    assert len(grid) == 6
    row = grid[grid["layer"] == 1]
    assert row["head"].tolist() == [0, 1] and set(row["kind"]) == {"no map"}
    assert set(row["reason"]) == {"Mamba layer: fixed-size state"}
    data = data_of(head_metric_heatmap(heads, "mean_sink_mass", selectable=False).to_dict())
    assert data[data["layer"] == 1]["value"].isna().all()
    assert data.set_index(["layer", "head"]).loc[(0, 0), "mark"] == "S"
    with pytest.raises(ValueError, match="unknown metric"):
        head_metric_heatmap(heads, "entropy")


def test_map_chart_carries_exactly_the_requested_block(att_trace):
    att = att_trace.attention
    tokens = att_trace.tokens
    rows, cols = range(10, 20), range(5, 13)
    block = att.block(2, 1, 0, rows=list(rows), cols=list(cols))
    cells = attention_block_frame(block, rows, cols, tokens)
    assert len(cells) == 10 * 8
    full = att.full(2, 1, 0)
    np.testing.assert_allclose(cells["weight"], full[10:20, 5:13].ravel())
    first = cells.iloc[0]
    assert first["query"] == f"10:{tokens['token'].iloc[10]}".replace(" ", "␣")
    spec = attention_map_chart(cells, title="L2 H1").to_dict()
    data = data_of(spec)
    assert len(data) == 80
    assert spec["encoding"]["x"]["field"] == "key" and spec["encoding"]["y"]["field"] == "query"
    assert spec["encoding"]["color"]["scale"]["domain"] == [0, 1]
    assert spec["title"]["subtitle"] == "10 queries × 8 keys"
    # future keys (j > i) are masked: 0 in the map
    assert (cells.loc[cells["key_pos"] > cells["query_pos"], "weight"] == 0).all()
    with pytest.raises(ValueError, match="does not match"):
        attention_block_frame(block, rows, range(3), tokens)


def test_row_frame_keeps_the_last_keys_and_says_how_much_it_shows(att_trace):
    att = att_trace.attention
    row = att.row(1, 3, 0, 20)
    frame = attention_row_frame(row, att_trace.tokens, pos=20, max_keys=8)
    assert frame["key_pos"].tolist() == list(range(13, 21))
    assert frame["distance"].tolist() == list(range(7, -1, -1))
    np.testing.assert_allclose(frame["weight"], row[13:21])
    spec = attention_row_chart(frame).to_dict()
    assert spec["mark"]["type"] == "bar"
    assert f"holding {row[13:21].sum():.1%}" in spec["title"]["subtitle"]
    whole = attention_row_frame(row, att_trace.tokens, pos=20, max_keys=1000)
    assert len(whole) == 21 and whole["weight"].sum() == pytest.approx(1.0)


def test_kv_whatif_heatmap_shows_mean_mass_lost(att_trace):
    whatif = kv_cache_whatif(att_trace.attention, 4, 1)
    spec = kv_whatif_heatmap(whatif).to_dict()
    data = data_of(spec)
    assert len(data) == 16
    np.testing.assert_allclose(data["mean_lost"], whatif["mean_lost"])
    assert data["text"].iloc[0] == f"{whatif['mean_lost'].iloc[0]:.0%}"
    cells, _ = spec["layer"]
    assert cells["encoding"]["color"]["field"] == "mean_lost"
    # a window covering everything loses nothing
    none_lost = kv_whatif_heatmap(kv_cache_whatif(att_trace.attention, 10_000, 0)).to_dict()
    assert (data_of(none_lost)["mean_lost"] < 1e-6).all()


def _heads(metric: str, values: list[float]) -> pd.DataFrame:
    """A head summary of one layer whose `metric` takes `values` (the other metrics 0.5)."""
    n = len(values)
    frame = pd.DataFrame({"layer": 0, "head": range(n), "kind": "global", "reason": ""})
    for name in HEAD_METRICS:
        frame[name] = values if name == metric else 0.5
    return frame


def _color_scale(chart) -> dict:
    cells, _ = chart.to_dict()["layer"]
    return cells["encoding"]["color"]["scale"]  # the no-map grey is the condition


# the narrowest colour domain each metric may get (see `head_metric_heatmap`)
MIN_SPAN = {
    "mean_entropy": np.log(2),
    "mean_mean_distance": 1.0,
    "mean_sink_mass": 1.0,
    "mean_local_mass": 1.0,
}


@pytest.mark.parametrize("num_tokens", [None, 40])
@pytest.mark.parametrize("metric", list(HEAD_METRICS))
def test_head_heatmap_colour_scale_does_not_span_floating_point_noise(metric, num_tokens):
    noise = [0.99999999, 1.0, 1.00000003, 0.99999998]  # e.g. local mass of heads that only look back W keys
    scale = _color_scale(head_metric_heatmap(_heads(metric, noise), metric, num_tokens=num_tokens))
    lo, hi = scale["domain"]
    assert hi - lo >= MIN_SPAN[metric] - 1e-12, scale
    assert lo <= min(noise) + 1e-6 and (hi >= max(noise) - 1e-6 or scale.get("clamp"))
    if metric in ("mean_sink_mass", "mean_local_mass"):
        assert [lo, hi] == [0, 1]  # shares of a probability row
    if num_tokens is not None and metric == "mean_entropy":
        assert hi == pytest.approx(np.log(num_tokens))  # the most a head can spread over T keys
    if num_tokens is not None and metric == "mean_mean_distance":
        assert hi == num_tokens - 1


@pytest.mark.parametrize("metric", list(HEAD_METRICS))
def test_head_heatmap_colour_scale_spans_values_that_vary(metric):
    values = {
        "mean_entropy": [0.1, 1.7, 3.2, 2.5],
        "mean_mean_distance": [0.0, 3.5, 17.0, 30.0],
        "mean_sink_mass": [0.02, 0.4, 0.97, 0.6],
        "mean_local_mass": [0.0, 0.25, 0.9, 1.0],
    }[metric]
    for num_tokens in (None, 32):
        scale = _color_scale(head_metric_heatmap(_heads(metric, values), metric, num_tokens=num_tokens))
        lo, hi = scale["domain"]
        assert lo <= min(values) and hi >= max(values), scale
        assert hi - lo <= max(max(values), np.log(32) if metric == "mean_entropy" else 31, 1.0) + 1e-9
