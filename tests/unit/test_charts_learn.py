"""The lesson's frames (`moeviz.analysis.lesson`) against hand computations on small synthetic routings, and
the Learn charts' Vega-Lite specs built from them (no model)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from moeviz.analysis.lesson import expert_token_share, router_walkthrough, token_weights_frame
from moeviz.analysis.losses import aux_loss_topk, router_probs
from moeviz.analysis.reroute import RerouteSettings, aux_terms, reroute
from moeviz.charts.learn import (
    aux_terms_chart,
    choice_load_chart,
    experts_sweep_chart,
    load_side_by_side_chart,
    router_walkthrough_chart,
    shared_experts_chart,
    token_weights_chart,
)
from moeviz.testing.scale_traces import synthetic_trace
from moeviz.trace import LayerRouting
from tests.support.charts import data_of
from tests.support.traces import routed_layer


@pytest.fixture(scope="module")
def softmax_routing() -> LayerRouting:
    """12 tokens, 6 experts, top-2 softmax routing with renormalised weights (Mixtral's rule)."""
    return routed_layer(np.random.default_rng(0).normal(size=(12, 6)), 2)


def test_walkthrough_goes_from_logits_to_renormalised_weights(softmax_routing) -> None:
    walk = router_walkthrough(softmax_routing, 3)
    p = np.exp(softmax_routing.logits[3]) / np.exp(softmax_routing.logits[3]).sum()
    np.testing.assert_allclose(walk["score"], p, rtol=1e-6)
    top = np.argsort(-p)[:2]
    assert walk.loc[walk["chosen"], "expert"].tolist() == sorted(top.tolist())
    np.testing.assert_allclose(walk.loc[top, "weight"], p[top] / p[top].sum(), rtol=1e-6)
    np.testing.assert_allclose(walk["weight"], walk["model_weight"], atol=1e-6)
    assert walk.loc[top[0], "rank"] == 0 and walk.loc[top[1], "rank"] == 1
    spec = router_walkthrough_chart(walk, k=2, score_fn="softmax", title="t").to_dict()
    assert len(spec["hconcat"]) == 3
    assert data_of(spec)["status"].value_counts()["chosen"] == 2


def test_token_weights_of_a_top_k_reroute(softmax_routing) -> None:
    tokens = pd.DataFrame({"seq": 0, "pos": range(12), "token": list("abcdefghijkl")})
    for k in (1, 2):
        rerouted = reroute(softmax_routing, RerouteSettings(k=k))
        frame = token_weights_frame(tokens, softmax_routing, rerouted.experts, rerouted.weights, limit=5)
        assert len(frame) == 5 * k and frame["rank"].tolist() == list(range(k)) * 5
        np.testing.assert_allclose(frame.groupby("pos")["weight"].sum(), 1, rtol=1e-6)
        top = np.argsort(-softmax_routing.scores[:5], axis=1)[:, :k]
        assert frame["expert"].tolist() == top.ravel().tolist()
        spec = token_weights_chart(frame, title="t").to_dict()
        assert data_of(spec)["slot"].unique().tolist() == ["1st expert", "2nd expert"][:k]


def test_aux_terms_chart_marks_the_even_term(softmax_routing) -> None:
    terms = aux_terms(softmax_routing)
    assert terms["term"].sum() == pytest.approx(aux_loss_topk(router_probs(softmax_routing), 2))
    data = data_of(aux_terms_chart(terms, k=2, title="t").to_dict())
    assert data["balanced"].unique().tolist() == [pytest.approx(2 / 6)]
    assert set(data["over"]) <= {"above the even value", "at or below it"}


def test_choice_load_chart_groups_two_routings() -> None:
    routing = synthetic_trace(
        num_experts=16, k=4, n_group=4, topk_group=2, num_blocks=2, first_dense=1
    ).layers[0]
    without = reroute(routing, RerouteSettings(k=4, score_fn="sigmoid"))
    assert 0 < without.changed_tokens < len(routing.token_rows)
    counts = {"with": without.captured_load, "without": without.load}
    load = pd.concat(
        [pd.DataFrame({"routing": name, "expert": range(16), "count": c}) for name, c in counts.items()]
    ).assign(fair=len(routing.token_rows) * 4 / 16)
    spec = choice_load_chart(load, title="t").to_dict()
    assert spec["layer"][0]["encoding"]["xOffset"]["field"] == "routing"
    assert data_of(spec)["count"].sum() == 2 * 4 * len(routing.token_rows)


def test_shared_experts_process_every_token() -> None:
    routing = synthetic_trace(
        num_experts=16, k=4, n_group=4, topk_group=2, num_blocks=2, first_dense=1
    ).layers[0]
    shares = expert_token_share(routing)
    assert shares.iloc[0].to_dict() == {"expert": "shared", "kind": "shared", "tokens": 1024, "share": 1.0}
    assert shares.loc[shares["kind"] == "routed", "share"].sum() == pytest.approx(4)
    data = data_of(shared_experts_chart(shares, k=4, title="t").to_dict())
    assert data["even"].iloc[0] == pytest.approx(0.25)


def test_side_by_side_and_sweep_specs() -> None:
    load = pd.DataFrame(
        {"model": ["a"] * 4 + ["b"] * 4, "expert": list(range(4)) * 2, "share": [0.25] * 4 + [1, 0, 0, 0]}
    ).assign(count=lambda d: d["share"] * 8)
    spec = load_side_by_side_chart(load, title="t").to_dict()
    assert spec["facet"]["column"]["field"] == "model"
    assert data_of(spec)["fair"].unique().tolist() == [0.25]
    sweep = pd.DataFrame(
        {"experts": [1, 4, 1, 4, 4], "k": [1, 1, 2, 2, 2], "heldout_loss": [3.0, 2.5, 2.9, 2.4, 2.6]}
    )
    spec = experts_sweep_chart(sweep).to_dict()
    assert spec["layer"][0]["encoding"]["x"]["scale"]["type"] == "log"
    data = data_of(spec)
    assert sorted(data["k"].unique()) == ["k = 1", "k = 2"]
    assert data.query("k == 'k = 2' and experts == 4")["heldout_loss"].tolist() == [pytest.approx(2.5)]


def test_aux_terms_compare_chart_draws_both_routings_terms() -> None:
    """The playground's per-expert aux terms: captured and re-routed bars side by side with their even
    values k/E; at 256 experts every 16th expert is labelled (not 256 rotated labels)."""
    from moeviz.charts.learn import aux_terms_compare_chart

    for experts in (8, 256):
        rng = np.random.default_rng(experts)
        terms = pd.DataFrame(
            {"expert": range(experts), "term_captured": rng.random(experts), "term": rng.random(experts)}
        )
        spec = aux_terms_compare_chart(terms, k=1, k_captured=2, title="t").to_dict()
        (rows,) = spec["datasets"].values()
        shown = pd.DataFrame(rows)
        for routing, column in (("captured", "term_captured"), ("re-routed", "term")):
            drawn = shown[shown["routing"] == routing].sort_values("expert")
            assert np.allclose(drawn["term"], terms[column]), routing
            assert np.allclose(drawn["even"], (2 if routing == "captured" else 1) / experts)
        axis = spec["layer"][0]["encoding"]["x"]["axis"]
        assert axis["labelAngle"] == 0 and axis["labelOverlap"] is False
        assert axis.get("values") == (list(range(0, 256, 16)) if experts > 20 else None)
