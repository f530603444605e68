"""Vega-Lite specs of the attention charts on the sample's captured attention: one cell per layer and head,
the map and row charts carry exactly the requested block of the captured map, and the KV what-if heatmap
its mass lost. Specs from constructed frames: tests/unit/test_charts_attention.py."""

from __future__ import annotations

import numpy as np
import pytest

import moeviz
from moeviz.charts import (
    HEAD_METRICS,
    HEAD_SELECTION,
    attention_block_frame,
    attention_map_chart,
    attention_row_chart,
    attention_row_frame,
    head_metric_heatmap,
    kv_whatif_heatmap,
)
from moeviz.whatif.kv_cache import kv_cache_whatif
from tests.support.charts import PROMPT, data_of


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
