"""Snapshot-style tests of the view charts' Vega-Lite specs, and binning that keeps totals."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

import moeviz
from moeviz import analysis
from moeviz.architecture import bias_frame, parameter_summary
from moeviz.charts import (
    agreement_chart,
    balance_chart,
    bias_chart,
    bin_rows,
    binned_dispatch_heatmap,
    coactivation_heatmap,
    dead_hot_experts,
    expert_timeline_chart,
    load_heatmap,
    load_shift_heatmap,
    path_chart,
    repetition_chart,
    stack_scores,
    token_layer_scores_chart,
    token_margin_chart,
    token_path_chart,
    token_strip_chart,
    transition_heatmaps,
)
from tests.support.charts import PROMPT, data_of


@pytest.fixture(scope="module")
def trace(sample_model) -> moeviz.Trace:
    return moeviz.capture(sample_model, PROMPT)


@pytest.fixture(scope="module")
def stacked(trace) -> pd.DataFrame:
    return stack_scores({key: trace.scores_frame(key[1], key[0]) for key in trace.layer_keys})


def marks(spec: dict) -> list[str]:
    layers = spec.get("layer") or [spec.get("spec", spec)]
    return [layer["mark"]["type"] if isinstance(layer["mark"], dict) else layer["mark"] for layer in layers]


def test_token_strip_colours_each_token_by_its_top1_expert(trace):
    routing = trace.layer(1)
    frame = trace.routing_frame().query("layer == 1")
    spec = token_strip_chart(frame, num_experts=routing.num_experts).to_dict()
    assert marks(spec) == ["rect", "text"]
    assert spec["layer"][0]["encoding"]["color"]["field"] == "top1"
    data = data_of(spec)
    assert len(data) == len(trace.tokens)
    assert data["top1"].tolist() == [str(e) for e in routing.experts[:, 0]]
    windowed = data_of(token_strip_chart(frame, num_experts=8, max_tokens=5, start=3).to_dict())
    assert windowed["pos"].tolist() == [3, 4, 5, 6, 7]


def test_expert_timeline_is_layers_by_tokens_of_one_expert(trace, stacked):
    spec = expert_timeline_chart(stacked, 3).to_dict()
    assert marks(spec) == ["rect", "text"]
    assert spec["layer"][0]["encoding"]["y"]["field"] == "layer"
    data = data_of(spec)
    assert len(data) == len(trace.layer_keys) * len(trace.tokens)
    for site, layer in trace.layer_keys:
        routing = trace.layer(layer, site)
        got = data[data["layer"] == layer].sort_values("order")
        np.testing.assert_allclose(got["score"], routing.scores[:, 3], rtol=1e-6)
        assert got["dispatched"].tolist() == (routing.experts == 3).any(1).tolist()


def test_token_drilldown_charts(trace, stacked):
    mine = stacked[(stacked["seq"] == 0) & (stacked["pos"] == 4)]
    data = data_of(token_layer_scores_chart(mine).to_dict())
    assert len(data) == len(trace.layer_keys) * 8
    assert data["dispatched"].sum() == len(trace.layer_keys) * 2
    row = int(np.flatnonzero((trace.tokens["seq"] == 0) & (trace.tokens["pos"] == 4))[0])
    for routing in trace.layers:  # the token's own scores and dispatch at every layer
        cells = data[data["layer"] == routing.layer].sort_values("expert")
        i = int(np.flatnonzero(routing.token_rows == row)[0])
        np.testing.assert_allclose(cells["score"], routing.scores[i], rtol=1e-6)
        assert set(cells.loc[cells["dispatched"], "expert"]) == set(routing.experts[i].tolist())
    rf = trace.routing_frame().query("seq == 0 and pos == 4")
    path = token_path_chart(rf).to_dict()
    assert marks(path) == ["line", "circle"]
    assert len(data_of(path)) == len(trace.layer_keys) * 2
    conf = analysis.confidence_frame(trace).query("pos == 4")
    margin = token_margin_chart(conf).to_dict()
    assert margin["mark"]["type"] == "bar" and margin["encoding"]["y"]["field"] == "margin"
    np.testing.assert_allclose(data_of(margin)["margin"], conf["margin"])


def test_load_heatmap_is_centred_on_the_fair_share(trace):
    frame = analysis.expert_balance_frame(trace)
    spec = load_heatmap(frame).to_dict()
    scale = spec["encoding"]["color"]["scale"]
    assert spec["mark"]["type"] == "rect" and scale["domainMid"] == 0 and scale["domain"] == [-3, 3]
    data = data_of(spec).sort_values(["layer", "expert"])
    assert len(data) == len(trace.layer_keys) * 8
    # each cell: log₂ of the expert's count over its fair share kT/E, clipped at 8× either way
    for routing in trace.layers:
        cells = data[data["layer"] == routing.layer]
        counts = np.bincount(routing.experts[routing.experts >= 0], minlength=routing.num_experts)
        util = counts / (len(routing.experts) * routing.k / routing.num_experts)
        np.testing.assert_allclose(cells["utilisation"], util, rtol=1e-12)
        np.testing.assert_allclose(cells["log2_util"], np.log2(np.clip(util, 1 / 8, 8)), rtol=1e-12)
    fair = data[np.isclose(data["utilisation"], 1.0)]
    assert np.allclose(fair["log2_util"], 0.0)


def test_balance_chart_draws_the_uniform_reference(trace):
    spec = balance_chart(analysis.balance_frame(trace), "max_share").to_dict()
    assert marks(spec) == ["bar", "tick"]
    data = data_of(spec).sort_values("layer")
    assert np.allclose(data["uniform"], 1 / 8)
    # the bars: each layer's largest share of the kT dispatched slots, counted directly
    want = [np.bincount(r.experts[r.experts >= 0]).max() / r.experts.size for r in trace.layers]
    np.testing.assert_allclose(data["value"], want, rtol=1e-12)
    with pytest.raises(ValueError):
        balance_chart(analysis.balance_frame(trace), "tokens")


def test_structure_charts(trace):
    coact = analysis.coactivation_frame(trace).query("layer == 0")
    spec = coactivation_heatmap(coact).to_dict()
    assert spec["title"]["subtitle"] == "all pairs of S_t"
    cells = data_of(spec)
    assert len(cells) == 8 * 7  # diagonal left out
    # P(j ∈ S | i ∈ S) over the layer's tokens, counted directly
    sets = [set(row) for row in trace.layer(0).experts.tolist()]
    for cell in cells.itertuples():
        with_i = [s for s in sets if cell.expert in s]
        assert cell.coactivation == pytest.approx(sum(cell.co_expert in s for s in with_i) / len(with_i))
    adjacent = analysis.coactivation_frame(trace, adjacent_only=True).query("layer == 0")
    assert "rank-adjacent" in coactivation_heatmap(adjacent).to_dict()["title"]["subtitle"]
    transitions = analysis.transition_frame(trace)
    trans = transition_heatmaps(transitions).to_dict()
    assert trans["spec"]["mark"]["type"] == "rect" and trans["facet"]["field"] == "pair"
    shown = data_of(trans)
    assert len(shown) == 3 * 8 * 8
    assert set(shown["pair"]) == {f"{a} → {a + 1}" for a in range(3)}
    key = ["layer", "expert", "next_expert"]
    np.testing.assert_allclose(
        shown.sort_values(key)["probability"], transitions.sort_values(key)["probability"].astype(float)
    )
    rep = analysis.repetition_frame(trace)
    rep_spec = repetition_chart(rep).to_dict()
    rep_data = data_of(rep_spec)
    assert len(rep_data) == 3 * len(rep)
    observed = rep_data[rep_data["series"] == "observed"].sort_values("layer")["p"]
    np.testing.assert_allclose(observed, rep["top1_repeat"])
    paths = analysis.path_frame(trace, top_n=5)
    assert data_of(path_chart(paths).to_dict())["count"].tolist() == paths["count"].tolist()


def test_compare_charts_against_itself(trace):
    agreement = data_of(agreement_chart(analysis.routing_agreement_frame(trace, trace)).to_dict())
    assert np.allclose(agreement["value"], 1.0)
    drift = analysis.expert_drift_frame(trace, trace)
    shift = data_of(load_shift_heatmap(drift).to_dict())
    assert (shift["load_change"] == 0).all() and len(shift) == len(drift)


def parameter_counts(model) -> tuple[int, int]:
    """Independent count: routed experts (".experts." parameters) contribute k/E of their parameters."""
    config = model.config
    total = sum(p.numel() for p in model.parameters())
    n_experts = getattr(config, "num_local_experts", None) or config.n_routed_experts
    routed = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    return total, int(total - routed * (1 - config.num_experts_per_tok / n_experts))


def test_bias_chart_and_parameters():
    loaded = moeviz.load_model("sample:deepseek-v3-bias")
    trace = moeviz.capture(loaded, "def add(a, b): return a + b")
    bias = bias_frame(trace)
    assert len(bias) == len(trace.layers) * 16
    spec = bias_chart(bias).to_dict()
    assert spec["spec"]["mark"]["type"] == "bar" and spec["facet"]["row"]["field"] == "layer"
    np.testing.assert_allclose(data_of(spec)["bias"], np.concatenate([r.bias for r in trace.layers]))
    params = parameter_summary(loaded.model)
    assert (params["total"], params["active"]) == parameter_counts(loaded.model)

    assert (params["experts"], params["top_k"]) == (16, 4)


def test_dead_hot_experts(trace):
    frame = analysis.expert_balance_frame(trace)
    flagged = dead_hot_experts(frame, hot_factor=2.5)
    assert set(flagged.query("status == 'dead'")["count"]) <= {0}
    assert (flagged.query("status == 'hot'")["utilisation"] > 2.5).all()
    assert len(flagged) == int(frame["dead"].sum() + (frame["utilisation"] > 2.5).sum())
    # the flagged (layer, expert) pairs, from the dispatch counts directly (fair share kT/E)
    want = {}
    for routing in trace.layers:
        counts = np.bincount(routing.experts[routing.experts >= 0], minlength=routing.num_experts)
        fair = len(routing.experts) * routing.k / routing.num_experts
        for e, c in enumerate(counts):
            if c == 0 or c / fair > 2.5:
                want[(routing.layer, e)] = "dead" if c == 0 else "hot"
    assert (
        dict(zip(zip(flagged["layer"], flagged["expert"], strict=True), flagged["status"], strict=True))
        == want
    )


def test_binning_keeps_totals():
    rng = np.random.default_rng(0)
    tokens, experts = 5003, 16
    frame = pd.DataFrame(
        {
            "row": np.repeat(np.arange(tokens), experts),
            "expert": np.tile(np.arange(experts), tokens),
            "score": rng.random(tokens * experts),
            "dispatched": rng.random(tokens * experts) < 0.25,
        }
    )
    binned = bin_rows(frame.astype({"dispatched": int}), sums=["dispatched", "score"], max_bins=200)
    assert binned["bin"].nunique() <= 200
    assert binned["dispatched"].sum() == frame["dispatched"].sum()
    assert binned["score"].sum() == pytest.approx(frame["score"].sum())
    per_expert = binned.groupby("expert")["dispatched"].sum()
    assert per_expert.tolist() == frame.groupby("expert")["dispatched"].sum().tolist()
    assert binned.groupby("bin")["tokens"].first().sum() == tokens
    # the chart ships at most max_bins × experts cells, and still every dispatch
    data = data_of(binned_dispatch_heatmap(frame, max_bins=200).to_dict())
    assert len(data) <= 200 * experts
    assert data["dispatched"].sum() == frame["dispatched"].sum()
    small = bin_rows(frame[frame["row"] < 50], max_bins=200, sums=["score"])
    assert len(small) == 50 * experts  # no binning when it already fits
