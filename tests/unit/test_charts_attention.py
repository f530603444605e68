"""Vega-Lite specs of the attention charts from constructed frames (no model): no-map layers and the colour
scale of the head heatmap. On the sample's captured attention:
tests/models/test_charts_attention_sample.py."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from moeviz.charts import (
    HEAD_METRICS,
    head_grid_frame,
    head_metric_heatmap,
)
from tests.support.charts import data_of


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
