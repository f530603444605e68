"""The engine diff charts draw the diff frames' own values (`moeviz.charts.engines`): per-layer differences,
the layer × position heatmap (rebinned long inputs keep their totals), margin quartiles, routers differing
per token and the token strip; at 58 layers and 2,000 positions every view stays bounded and labelled."""

from __future__ import annotations

import altair as alt
import numpy as np
import pandas as pd
import pytest

from moeviz.analysis.engine_diff import engine_diff
from moeviz.charts import engines as charts
from tests.support.charts import data_of
from tests.support.traces import make_layer, make_trace, random_sets

NAN = float("nan")


def spec_of(chart) -> dict:
    with alt.data_transformers.enable(max_rows=None):  # as the app draws it (exports.show_chart)
        return chart.to_dict()  # validates against the Vega-Lite schema


def views(node):
    """Every dict of a spec that has an `encoding`."""
    if isinstance(node, dict):
        if isinstance(node.get("encoding"), dict):
            yield node
        for key, value in node.items():
            if key != "datasets":
                yield from views(value)
    elif isinstance(node, list):
        for value in node:
            yield from views(value)


def layers_frame() -> pd.DataFrame:
    """An `EngineDiff.layers` of three layers: the middle one unranked on one side (top-1 NaN), the last
    one without logits on one side (KL, TV NaN)."""
    return pd.DataFrame(
        {
            "layer": [1, 2, 3],
            "site": "mlp",
            "pairs": [40, 40, 40],
            "mismatched": [2, 0, 5],
            "router_mismatch": [0.05, 0.0, 0.125],
            "top1_mismatch": [0.025, NAN, 0.1],
            "jaccard": [0.97, 1.0, 0.9],
            "kl": [1e-4, 0.0, NAN],
            "tv": [0.01, 0.0, NAN],
            "logits_equal": [False, True, None],
        }
    )


def test_layer_chart_draws_each_difference_and_skips_what_is_undefined() -> None:
    layers = layers_frame()
    spec = spec_of(charts.layer_mismatch_chart(layers))
    data = data_of(spec)
    by_metric = {name: part.sort_values("row") for name, part in data.groupby("metric")}
    names = charts.LAYER_METRICS
    assert by_metric[names["router_mismatch"]]["value"].tolist() == [0.05, 0.0, 0.125]
    assert by_metric[names["top1_mismatch"]]["value"].tolist() == [0.025, 0.1]  # NaN: not drawn
    assert by_metric[names["top1_mismatch"]]["layer_label"].tolist() == ["1", "3"]
    assert by_metric[names["jaccard_distance"]]["value"].tolist() == pytest.approx([0.03, 0.0, 0.1])
    assert by_metric[names["tv"]]["value"].tolist() == [0.01, 0.0]
    assert by_metric[names["router_mismatch"]]["mismatched"].tolist() == [2, 0, 5]
    # layers are positions 0..2 on a quantitative axis, each tick labelled with its layer
    x = spec["layer"][0]["encoding"]["x"]
    assert x["type"] == "quantitative" and x["axis"]["labelOverlap"] is False
    assert "['1','2','3'][datum.value]" in x["axis"]["labelExpr"]
    assert spec["layer"][0]["encoding"]["color"]["scale"]["domain"] == list(names.values())


def test_layer_chart_of_identical_routing_keeps_a_readable_axis() -> None:
    layers = layers_frame().assign(router_mismatch=0.0, top1_mismatch=0.0, jaccard=1.0, kl=0.0, tv=0.0)
    spec = spec_of(charts.layer_mismatch_chart(layers))
    assert set(data_of(spec)["value"]) == {0.0}
    assert spec["layer"][0]["encoding"]["y"]["scale"]["domain"] == [0, 0.01]  # not a zero-height axis


def position_frame(layers=(0, 1), width: int = 1, bins: int = 6, seed: int = 0) -> pd.DataFrame:
    """A `layer_position_frame()`: every bin of each layer with random pairs and mismatched."""
    rng = np.random.default_rng(seed)
    rows = []
    for layer in layers:
        for b in range(bins):
            pairs = int(rng.integers(1, 9))
            mismatched = int(rng.integers(0, pairs + 1))
            rows.append(
                (layer, "mlp", b * width, b * width + width - 1, pairs, mismatched, mismatched / pairs)
            )
    return pd.DataFrame(rows, columns=charts.POSITION_COLUMNS)


def test_position_heatmap_draws_each_cell_with_its_edges() -> None:
    frame = position_frame()
    spec = spec_of(charts.position_heatmap(frame))
    data = data_of(spec)
    assert data["router_mismatch"].tolist() == pytest.approx(frame["router_mismatch"].tolist())
    assert data["mismatched"].tolist() == frame["mismatched"].tolist()
    assert data["x0"].tolist() == (frame["pos_start"] - 0.5).tolist()
    assert data["x1"].tolist() == (frame["pos_end"] + 0.5).tolist()
    assert data["y0"].tolist() == ([-0.5] * 6 + [0.5] * 6)  # layer 0 on row 0, layer 1 on row 1
    assert spec["encoding"]["color"]["field"] == "router_mismatch"
    assert spec["encoding"]["color"]["scale"]["domain"] == [0, frame["router_mismatch"].max()]


def test_long_inputs_are_rebinned_keeping_every_total() -> None:
    frame = position_frame(layers=range(5), width=3, bins=1000)  # 3,000 positions in library bins of 3
    binned = charts.rebinned_positions(frame, max_bins=100)
    assert binned.groupby("layer").size().tolist() == [100] * 5
    assert set(binned["pos_end"] - binned["pos_start"] + 1) == {30}  # 10 bins of 3 merged
    for column in ("pairs", "mismatched"):  # totals per layer survive
        assert binned.groupby("layer")[column].sum().tolist() == frame.groupby("layer")[column].sum().tolist()
    first = frame[(frame["layer"] == 2) & (frame["pos_start"] < 30)]  # one merged cell, by hand
    cell = binned[(binned["layer"] == 2) & (binned["pos_start"] == 0)].iloc[0]
    assert cell["router_mismatch"] == first["mismatched"].sum() / first["pairs"].sum()
    assert len(data_of(spec_of(charts.position_heatmap(frame, max_bins=100)))) == 500
    assert charts.rebinned_positions(position_frame()).equals(position_frame())  # fits: unchanged


def test_margin_quartile_chart_labels_each_bar_with_its_counts() -> None:
    quartiles = pd.DataFrame(
        {
            "quartile": [1, 2, 3, 4],
            "margin_low": [0.0, 0.1, 0.2, 0.3],
            "margin_high": [0.1, 0.2, 0.3, np.inf],
            "pairs": [25, 25, 25, 25],
            "mismatched": [5, 1, 0, 0],
            "router_mismatch": [0.2, 0.04, 0.0, 0.0],
        }
    )
    spec = spec_of(charts.margin_quartile_chart(quartiles, side="B"))
    data = data_of(spec)
    assert data["router_mismatch"].tolist() == [0.2, 0.04, 0.0, 0.0]
    assert data["label"].tolist() == ["5 / 25", "1 / 25", "0 / 25", "0 / 25"]
    assert spec["layer"][0]["encoding"]["x"]["title"] == "router margin quartile of B (1 = lowest)"
    assert spec["layer"][0]["encoding"]["y"]["scale"]["domain"] == [0, pytest.approx(0.23)]  # room for labels


def test_routers_per_token_chart_draws_the_distribution() -> None:
    routers = pd.DataFrame({"routers": [0, 1, 2, 3, 4, 5], "tokens": [20, 5, 0, 1, 0, 0]})
    routers["fraction"] = routers["tokens"] / 26
    spec = spec_of(charts.routers_per_token_chart(routers))
    data = data_of(spec)
    assert data["tokens"].tolist() == [20, 5, 0, 1]  # up to the largest count a token has
    assert data["x0"].tolist() == [-0.4, 0.6, 1.6, 2.6]
    assert spec["encoding"]["x"]["scale"]["domain"] == [-0.5, 3.5]
    assert spec["title"]["subtitle"] == "of 5 MoE layers"


def test_token_strip_colours_each_token_by_its_differing_layers() -> None:
    tokens = pd.DataFrame(
        {
            "seq": 0,
            "pos": range(6),
            "token_id": range(6),
            "token": ["The", " for", " loop", "\n", "x", "y"],
            "routers_differing": [0, 2, 5, 0, -1, 1],
        }
    )
    spec = spec_of(charts.routers_strip_chart(tokens, num_layers=58, max_tokens=4, start=1))
    data = data_of(spec)
    assert data["pos"].tolist() == [1, 2, 3, 4]  # the window
    assert data["routers_differing"].tolist() == [2, 5, 0, -1]
    assert data["differing"].tolist() == ["2 of 58", "5 of 58", "0 of 58", "not paired"]
    assert data["text"].tolist() == ["␣for", "␣loop", "↵", "x"]
    colour = spec["layer"][0]["encoding"]["color"]
    assert colour["condition"]["test"] == "datum.routers_differing < 0"  # grey: one side did not route it
    assert colour["condition"]["value"] == charts.NOT_PAIRED
    assert colour["scale"]["domain"] == [0, 5] and colour["legend"]["values"] == [0, 1, 2, 3, 4, 5]


def test_at_58_layers_every_view_is_bounded_and_labelled() -> None:
    """A DeepSeek-V3-shaped diff (58 MoE layers, 256 experts, top-8) of 2,000 tokens: no view has a mark or
    a legend entry per expert, the heatmap stays within 58 × 100 cells, every layer keeps its label."""
    rng = np.random.default_rng(0)
    n, e, k = 2000, 256, 8
    layers_a = [make_layer(random_sets(rng, n, e, k), e, layer=3 + i) for i in range(58)]
    layers_b = []
    for routing in layers_a:  # B: a few tokens of each layer with another set
        experts = routing.experts.copy()
        changed = rng.choice(n, 40, replace=False)
        experts[changed] = random_sets(rng, 40, e, k)
        layers_b.append(make_layer(experts, e, layer=routing.layer))
    diff = engine_diff(make_trace(layers_a), make_trace(layers_b))
    specs = [
        spec_of(charts.layer_mismatch_chart(diff.layers)),
        spec_of(charts.position_heatmap(diff.layer_position_frame())),
        spec_of(charts.routers_per_token_chart(diff.routers_frame())),
        spec_of(charts.routers_strip_chart(diff.token_frame(), num_layers=58)),
    ]
    for spec in specs:
        encoded = {
            enc.get("field")
            for view in views(spec)
            for enc in view["encoding"].values()
            if isinstance(enc, dict)
        }
        assert "expert" not in encoded
    heatmap = data_of(specs[1])
    assert len(heatmap) <= 58 * charts.MAX_POSITION_BINS
    assert heatmap["mismatched"].sum() == diff.mismatched  # rebinning lost nothing
    axis = specs[1]["encoding"]["y"]["axis"]
    assert all(f"'{layer}'" in axis["labelExpr"] for layer in range(3, 61))
    assert len(data_of(specs[3])) == 400  # the strip's window
