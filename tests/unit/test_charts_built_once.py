"""The layered charts a Routing layer switch and a token's drill-down rebuild (at 256 experts × 58 layers) are
each constructed once: altair constructs a layered chart again, deep-copying every layer twice, on any
method called after it (`.properties`, `.resolve_scale`), so their top-level properties go in the layer call
(`moeviz.charts._common.layered_chart`). The app's canvas switch: tests/app/test_chart_files.py."""

from __future__ import annotations

import altair as alt
import numpy as np
import pytest

from moeviz.analysis import expert_balance_frame, token_scores_frame
from moeviz.analysis.null import expert_confidence_frame
from moeviz.charts import (
    expert_load_curve_chart,
    router_score_heatmap,
    token_layer_scores_chart,
    token_rank_path_chart,
    token_strip_chart,
)
from moeviz.charts.attention import map_ramp
from moeviz.charts.raster import raster_heatmap
from moeviz.testing.scale_traces import synthetic_trace
from moeviz.trace import Trace
from tests.support.charts import count_layer_charts


@pytest.fixture(scope="module")
def trace():
    """256 experts, top-8 from 4 of 8 groups, 58 MoE layers, 120 tokens."""
    return synthetic_trace(num_tokens=120)


@pytest.fixture
def constructions(monkeypatch) -> list[alt.LayerChart]:
    return count_layer_charts(monkeypatch)


CHARTS = {
    "router score heatmap": lambda t, layer: router_score_heatmap(
        t.scores_frame(layer.layer), max_tokens=64, experts=list(range(16))
    ),
    "token strip": lambda t, layer: token_strip_chart(
        Trace(t.model, t.tokens, [layer]).routing_frame(),
        num_experts=layer.num_experts,
        n_group=8,
        highlight=3,
    ),
    "load curve with bands": lambda t, layer: expert_load_curve_chart(
        expert_balance_frame(Trace(t.model, t.tokens, [layer])),
        highlight=3,
        bands=expert_confidence_frame(Trace(t.model, t.tokens, [layer]), draws=20),
    ),
    "token scores": lambda t, layer: token_layer_scores_chart(token_scores_frame(t, 0, 5)),
    "rank path, raster": lambda t, layer: token_rank_path_chart(token_scores_frame(t, 0, 5), raster=True),
    "rank path, cells": lambda t, layer: token_rank_path_chart(token_scores_frame(t, 0, 5), raster=False),
    "raster heatmap (the attention map's)": lambda t, layer: raster_heatmap(
        np.eye(40), map_ramp("linear"), row_title="query", col_title="key", value_title="p", title="map"
    ),
}


@pytest.mark.parametrize("name", list(CHARTS))
def test_a_layered_chart_is_constructed_once(trace, constructions, name):
    layer = trace.layers[len(trace.layers) // 2]
    build = CHARTS[name]
    before = len(constructions)
    chart = build(trace, layer)
    assert isinstance(chart, alt.LayerChart)
    made = constructions[before:]
    assert len(made) == 1 and made[0] is chart, f"{name}: {len(made)} LayerChart constructions for one chart"
    # the control: a property set after the layer call constructs it again
    chart.properties(height=100)
    assert len(constructions) == before + 2
