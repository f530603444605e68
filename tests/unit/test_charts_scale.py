"""Views at scale: charts over random traces shaped like DeepSeek-V3 (256 experts, top-8 from 4 of 8 groups,
58 MoE layers) and Kimi K2 (384 experts, top-8, 60 MoE layers), ~1k tokens, built without a model.

Each chart: a valid Vega-Lite spec (altair validates on `to_dict`), bounded data, no categorical legend
over 20 entries, no axis that may drop labels. The build times: benchmarks/bench_scale_views.py."""

from __future__ import annotations

import json
import re

import altair as alt
import numpy as np
import pandas as pd
import pytest

from moeviz.analysis import confidence_frame, expert_balance_frame
from moeviz.analysis.expert_order import expert_order, top_experts
from moeviz.analysis.null import bootstrap_counts, load_confidence
from moeviz.analysis.scale_frames import mean_score_frame, token_confidence_frame, token_scores_frame
from moeviz.analysis.structure import coactivation_counts
from moeviz.charts import stack_scores
from moeviz.charts.routing import router_score_heatmap, token_margin_chart, token_strip_chart
from moeviz.charts.scale import (
    EXPERT_BRUSH,
    MAX_CATEGORICAL,
    expert_load_curve_chart,
    layer_expert_heatmap,
    token_rank_path_chart,
)
from moeviz.testing.scale_traces import shaped_trace, synthetic_trace
from moeviz.trace import Trace

MAX_ROWS = 30_000  # rows shipped per chart


@pytest.fixture(scope="module", params=["deepseek_v3", "kimi_k2"])
def big(request) -> dict:
    trace = shaped_trace(request.param, num_tokens=1024)
    balance = expert_balance_frame(trace)
    return {"name": request.param, "trace": trace, "balance": balance}


# ---- spec checks -----------------------------------------------------------------------------------------
def spec_of(chart) -> dict:
    """The validated Vega-Lite spec (altair's 5,000-row guard lifted: Streamlit ships data as Arrow)."""
    with alt.data_transformers.enable(max_rows=None):
        return chart.to_dict()


def shipped_rows(spec: dict) -> int:
    rows = sum(len(v) for v in spec.get("datasets", {}).values())
    return rows + sum(len(d["values"]) for d in walk(spec, "data") if isinstance(d.get("values"), list))


def walk(node, key: str):
    """Every dict value stored under `key` anywhere in the spec."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k == key and isinstance(v, dict):
                yield v
            yield from walk(v, key)
    elif isinstance(node, list):
        for v in node:
            yield from walk(v, key)


def encodings(spec: dict):
    yield from walk(spec, "encoding")


def check_spec(chart, *, data_rows: int | None = None) -> dict:
    spec = spec_of(chart)
    rows = shipped_rows(spec)
    assert 0 < rows < MAX_ROWS
    if data_rows is not None:
        assert rows == data_rows
    data = pd.DataFrame(max(spec["datasets"].values(), key=len))  # the cells (small extra layers aside)
    for enc in encodings(spec):
        colour = enc.get("color")
        for channel in [colour, *(colour or {}).get("condition", [])] if isinstance(colour, dict) else []:
            if not isinstance(channel, dict) or channel.get("type") not in ("nominal", "ordinal"):
                continue
            domain = (channel.get("scale") or {}).get("domain")
            entries = len(domain) if isinstance(domain, list) else data[channel["field"]].nunique()
            assert entries <= MAX_CATEGORICAL + 1, f"categorical legend with {entries} entries"  # + dropped
        for axis_channel in ("x", "y"):
            ch = enc.get(axis_channel)
            if not isinstance(ch, dict) or ("axis" in ch and ch["axis"] is None) or "field" not in ch:
                continue
            axis = ch.get("axis") or {}
            assert axis.get("labelOverlap") is False, f"{axis_channel} axis may drop labels: {ch}"
            expr = axis.get("labelExpr")
            if expr and "[" in expr:  # a position → label lookup covers every position
                size = int(re.search(r"datum\.value < (\d+)", expr).group(1))
                assert len(re.search(r"\[(.*)\]\[datum\.value\]", expr).group(1).split(",")) == size
    return spec


# ---- layer × expert heatmap ------------------------------------------------------------------------------
def test_layer_expert_heatmap_overview_and_detail(big):
    trace, balance = big["trace"], big["balance"]
    e = trace.layers[0].num_experts
    chart = layer_expert_heatmap(balance, "utilisation", highlight=7, raster=False)  # rects (see test_raster)
    # every (layer, expert) cell once, and the outlined expert's cells once more (their own small data)
    spec = check_spec(chart, data_rows=len(trace.layers) * e + len(trace.layers))
    overview, detail = spec["vconcat"]
    params = [p for view in (spec, overview, overview["layer"][0]) for p in view.get("params", [])]
    (brush,) = [p for p in params if p["name"] == EXPERT_BRUSH]
    assert brush["select"]["type"] == "interval" and brush["select"]["encodings"] == ["x"]
    assert detail["layer"][0]["encoding"]["x"]["scale"]["domain"] == {"param": EXPERT_BRUSH, "encoding": "x"}
    assert overview["width"] / e <= 3  # 1–3 px per expert in the overview
    highlighted = [layer for view in (overview, detail) for layer in view["layer"][1:]]
    outlined = [pd.DataFrame(spec["datasets"][h["data"]["name"]]) for h in highlighted]
    assert outlined and all(set(o["expert"]) == {7} and len(o) == len(trace.layers) for o in outlined)
    # score heatmap and a sort by co-activation PC1: the axis labels are the ids in that order
    pair, _ = coactivation_counts(trace.layers[5], False)
    order = expert_order(
        balance[balance["layer"] == trace.layers[5].layer], "coactivation", coactivation=pair
    )
    assert sorted(order.tolist()) == list(range(e))
    chart = layer_expert_heatmap(mean_score_frame(trace), "score", order=order, raster=False)
    spec = check_spec(chart)
    expr = spec["vconcat"][0]["layer"][0]["encoding"]["x"]["axis"]["labelExpr"]
    assert expr.split("][datum.value]")[0].endswith(",".join(str(int(i)) for i in order[-3:]))


def test_layer_expert_heatmap_top_n_filter_is_the_small_view(big):
    balance = big["balance"]
    top = top_experts(balance, 12)
    order = expert_order(top, by="load")
    order = order[np.isin(order, top["expert"].unique())]
    spec = check_spec(layer_expert_heatmap(top, order=order, order_name="load"))
    assert "vconcat" not in spec  # ≤ 20 experts: the plain heatmap, every expert labelled
    assert spec["layer"][0]["encoding"]["x"]["sort"] == order.tolist()
    assert len(spec_of_data(spec)) == 12 * len(big["trace"].layers)


def spec_of_data(spec: dict) -> pd.DataFrame:
    (values,) = spec["datasets"].values()
    return pd.DataFrame(values)


# ---- token strip, load curve, path by rank, margin -------------------------------------------------------
def test_token_strip_never_lists_hundreds_of_experts(big):
    trace = big["trace"]
    routing = trace.layers[3]
    rows = Trace(trace.model, trace.tokens, [routing]).routing_frame()
    for n_group in (routing.n_group, None):
        chart = token_strip_chart(
            rows, num_experts=routing.num_experts, n_group=n_group, highlight=int(routing.experts[0, 0])
        )
        spec = check_spec(chart, data_rows=400)
        colour = spec["layer"][0]["encoding"]["color"]
        assert colour["condition"]["test"] == "datum.expert < 0"  # dropped: grey
        if n_group:
            assert colour["field"] == "group" and len(colour["scale"]["domain"]) == n_group
        else:
            assert colour["field"] == "expert" and colour["type"] == "quantitative"
        # the outlined tokens come from a column of the data (another choice keeps the spec): exactly those
        # whose top-1 is the chosen expert
        assert spec["layer"][1]["transform"] == [{"filter": "datum.chosen"}]
        data = spec_of_data(spec)
        assert (data["chosen"] == (data["expert"] == int(routing.experts[0, 0]))).all()
        assert data["chosen"].any()


def test_expert_load_curve_is_sorted_with_the_fair_share(big):
    balance = big["balance"]
    layer = balance[balance["layer"] == balance["layer"].iloc[0]]
    chart = expert_load_curve_chart(layer, highlight=3)
    spec = check_spec(chart, data_rows=len(layer))
    data = spec_of_data(spec)
    # the chosen expert is marked through a column of the data, not a constant of the spec
    assert data.loc[data["chosen"], "expert"].tolist() == [3]
    assert "datum.expert == 3" not in json.dumps(spec)
    assert data["count"].is_monotonic_decreasing and data["rank"].tolist() == list(range(len(layer)))
    assert {"datum": 1.0} in [layer["encoding"].get("y") for layer in spec["layer"]]


def test_expert_load_curve_band_is_the_bootstrap_of_each_ranked_expert(big):
    trace, balance = big["trace"], big["balance"]
    routing = trace.layers[0]
    layer = balance[(balance["layer"] == routing.layer) & (balance["site"] == routing.site)]
    e, draws = routing.num_experts, 400
    conf = load_confidence(routing, draws=draws)
    bands = pd.DataFrame(
        {
            "expert": np.arange(e),
            "share": conf.share,
            "share_low": conf.share_low,
            "share_high": conf.share_high,
        }
    ).sample(frac=1.0, random_state=1)  # rows out of order: the band is matched by expert, not by position
    chart = expert_load_curve_chart(layer, highlight=3, bands=bands)
    spec = check_spec(chart, data_rows=e)  # still one row per expert
    data = spec_of_data(spec).sort_values("rank")
    # independently: the same resamples of the tokens, in utilisation c_e / (kT/E), quantiles per expert
    boot = bootstrap_counts(routing.experts, e, draws, 0) / (len(routing.experts) * routing.k / e)
    low, high = np.quantile(boot, [0.05, 0.95], axis=0)
    ranked = data["expert"].to_numpy()
    np.testing.assert_allclose(data["util_low"], low[ranked], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(data["util_high"], high[ranked], rtol=1e-9, atol=1e-12)
    # the band follows the curve's order: each rank's band holds that rank's utilisation, and a band in
    # expert order (not rank order) would not
    util = data["utilisation"].to_numpy()
    assert (data["util_low"].to_numpy() <= util + 1e-12).all() and (util <= data["util_high"] + 1e-12).all()
    assert not ((low <= util + 1e-12) & (util <= high + 1e-12)).all()
    assert data["count"].is_monotonic_decreasing
    (band,) = [view for view in spec["layer"] if view["encoding"].get("y2") == {"field": "util_high"}]
    assert band["encoding"]["x"]["field"] == "rank" and band["encoding"]["y"]["field"] == "util_low"
    assert "band low (utilisation)" in json.dumps(band["encoding"]["tooltip"])


@pytest.mark.parametrize("rank_by", ["score", "selection_score", "load"])
def test_token_rank_path_is_bounded_by_layers_times_ranks(big, rank_by):
    trace, balance = big["trace"], big["balance"]
    mine = token_scores_frame(trace, 0, 17)
    chart = token_rank_path_chart(mine, rank_by=rank_by, load=balance)
    spec = check_spec(chart)
    data = pd.DataFrame(spec["datasets"][spec["data"]["name"]])  # every cell shown
    picked = data[data["dispatched"]]
    # the dots (and the top-1 line) draw data of their own: the dispatched rows (of slot 0), no filter
    own = {
        view["mark"]["type"]: pd.DataFrame(spec["datasets"][view["data"]["name"]])
        for view in spec["layer"][-2:]
    }
    pd.testing.assert_frame_equal(own["circle"], picked.reset_index(drop=True))
    pd.testing.assert_frame_equal(own["line"], picked[picked["slot"] == 0].reset_index(drop=True))
    assert "filter" not in json.dumps(spec)
    assert len(picked) == 8 * len(trace.layers)
    assert sorted(picked["slot"].unique()) == list(range(8))
    for routing in trace.layers:  # the dots are the dispatched experts, at their rank
        got = picked[picked["layer"] == routing.layer]
        assert sorted(got["expert"]) == sorted(routing.experts[17])
        if rank_by == "score":
            ranks = np.argsort(np.argsort(-routing.scores[17], kind="stable"), kind="stable")
            assert got.set_index("expert")["rank"].to_dict() == {int(x): int(ranks[x]) for x in got["expert"]}
    if rank_by == "load":
        assert len(data) == len(picked)


def test_margin_chart_shows_real_values_for_a_grouped_sigmoid_router():
    trace = synthetic_trace(num_tokens=48, seed=4)  # DeepSeek-V3 shaped, 58 layers, fewer tokens
    conf = confidence_frame(trace)
    assert conf["margin_selection"].notna().all() and (conf["margin_selection"] > 0).mean() > 0.95
    spec = check_spec(token_margin_chart(conf[conf["pos"] == 9]))
    assert spec["encoding"]["y"]["field"] == "margin_selection"
    assert spec["encoding"]["x"]["axis"]["labelAngle"] == -90


def test_token_scores_frame_is_the_stacked_scores_of_one_token():
    trace = synthetic_trace(
        num_experts=32, k=4, n_group=4, topk_group=2, num_blocks=4, first_dense=1, num_tokens=9
    )
    stacked = stack_scores({key: trace.scores_frame(key[1], key[0]) for key in trace.layer_keys})
    want = stacked[(stacked["seq"] == 0) & (stacked["pos"] == 5)].reset_index(drop=True)
    got = token_scores_frame(trace, 0, 5)
    for column in ("layer", "expert", "score", "selection_score", "weight", "dispatched"):
        np.testing.assert_array_equal(got[column].to_numpy(), want[column].to_numpy())
    means = mean_score_frame(trace)
    first = trace.layers[0]
    np.testing.assert_allclose(means[means["layer"] == first.layer]["score"], first.scores.mean(0), rtol=1e-6)
    with pytest.raises(KeyError):
        token_scores_frame(trace, 0, 99)
    conf = confidence_frame(trace)
    want = conf[conf["pos"] == 5].reset_index(drop=True)
    got = token_confidence_frame(trace, 0, 5)
    pd.testing.assert_frame_equal(got, want, check_dtype=False)


def test_router_score_heatmap_on_a_chosen_subset_of_experts(big):
    trace, balance = big["trace"], big["balance"]
    routing = trace.layers[2]
    layer = balance[balance["layer"] == routing.layer]
    chosen = int(routing.experts[0, -1])
    experts = [*expert_order(layer, by="load")[:15].tolist(), chosen]
    frame = trace.scores_frame(routing.layer)
    chart = router_score_heatmap(frame, max_tokens=200, experts=experts)
    spec = spec_of(chart)
    data = spec_of_data(spec)
    assert sorted(data["expert"].unique()) == sorted(set(experts)) and len(data) == 200 * len(set(experts))
    assert spec["layer"][0]["encoding"]["y"]["sort"] == experts


def test_one_tokens_scores_at_every_layer_with_dispatch_dots(big):
    trace = big["trace"]
    mine = token_scores_frame(trace, 0, 40)
    chart = layer_expert_heatmap(mine, "score", highlight=int(trace.layers[0].experts[40, 0]), raster=False)
    layers = len(trace.layers)
    # the cells, the outlined expert's cells (a row per layer) and the dispatched cells (k per layer)
    spec = check_spec(chart, data_rows=len(mine) + layers + 8 * layers)
    detail = spec["vconcat"][1]
    (dots,) = [layer for layer in detail["layer"] if layer["mark"]["type"] == "circle"]
    dotted = pd.DataFrame(spec["datasets"][dots["data"]["name"]])
    assert dotted["dispatched"].all() and len(dotted) == 8 * layers
    cells = pd.DataFrame(max(spec["datasets"].values(), key=len))
    assert cells["dispatched"].sum() == 8 * layers
