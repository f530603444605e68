"""The per-layer and per-expert frames of `moeviz.analysis.scale_frames` (what the app's views at scale read
instead of the N × E × L tables), each against a computation of its own from the trace's arrays: token by
token, pair by pair. On a small synthetic trace with two sites and capacity-dropped slots."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest

from moeviz.analysis import (
    coactivation_pair_counts,
    expert_scores_frame,
    filter_experts,
    layer_coactivation_frame,
    layer_scores_frame,
    layer_trace,
    next_layer_transition_frame,
)
from moeviz.testing.scale_traces import synthetic_trace
from moeviz.trace import Trace

E, K = 24, 4


@pytest.fixture(scope="module")
def trace() -> Trace:
    """Three MoE layers at site mlp and two at site decoder (the same arrays, another site), with a few
    slots dropped (expert -1) in every layer."""
    base = synthetic_trace(
        num_experts=E, k=K, n_group=4, topk_group=2, num_blocks=4, first_dense=1, num_tokens=40
    )
    layers = []
    for i, routing in enumerate([*base.layers, *base.layers[:2]]):
        experts = routing.experts.copy()
        experts[(np.arange(len(experts)) + i) % 7 == 0, -1] = -1  # capacity dropped the last slot
        site = "mlp" if i < len(base.layers) else "decoder"
        layers.append(
            dataclasses.replace(routing, experts=experts, site=site, layer=routing.layer + 10 * (i >= 3))
        )
    return dataclasses.replace(base, layers=layers)


def sets(routing) -> list[set[int]]:
    """Each token's dispatched experts."""
    return [{int(e) for e in row if e >= 0} for row in routing.experts]


def test_layer_trace_keeps_one_layer(trace):
    one = layer_trace(trace, 11, "decoder")
    assert [r.key for r in one.layers] == [("decoder", 11)] and one.attention is None
    assert one.layers[0] is trace.layer(11, "decoder") and one.tokens is trace.tokens


def test_layer_scores_frame_is_the_scores_frame_of_the_chosen_experts(trace):
    routing = trace.layer(2, "mlp")
    pd.testing.assert_frame_equal(layer_scores_frame(trace, 2, "mlp"), trace.scores_frame(2, "mlp"))
    experts = [17, 3, 9]
    got = layer_scores_frame(trace, 2, "mlp", experts)
    assert len(got) == len(routing.token_rows) * len(experts)
    assert got["expert"].tolist() == experts * len(routing.token_rows)  # in the order asked for, per token
    dispatched = sets(routing)
    for row in got.itertuples():
        assert row.score == routing.scores[row.row, row.expert]
        assert row.logit == routing.logits[row.row, row.expert]
        assert row.dispatched == (row.expert in dispatched[row.row])
        slots = np.flatnonzero(routing.experts[row.row] == row.expert)
        assert row.weight == (routing.weights[row.row, slots[0]] if len(slots) else 0.0)
        assert (row.seq, row.pos) == tuple(trace.tokens.iloc[routing.token_rows[row.row]][["seq", "pos"]])


def test_expert_scores_frame_is_one_expert_at_every_layer(trace):
    for site, layers in (("mlp", [1, 2, 3]), ("decoder", [11, 12]), (None, [1, 2, 3, 11, 12])):
        got = expert_scores_frame(trace, 5, site)
        assert sorted(set(got["layer"])) == layers
        for (where, layer), rows in got.groupby(["site", "layer"]):
            routing = trace.layer(layer, where)
            np.testing.assert_array_equal(rows["score"], routing.scores[:, 5])
            assert rows["dispatched"].tolist() == [5 in s for s in sets(routing)]
            assert rows["row"].tolist() == list(range(len(routing.token_rows)))
            assert (rows["expert"] == 5).all()
    assert expert_scores_frame(trace, E + 3).empty  # no such expert: no rows


def test_coactivation_pair_counts_count_tokens_per_pair(trace):
    def brute(routing) -> np.ndarray:
        pair = np.zeros((E, E))
        for chosen in sets(routing):
            for i in chosen:
                for j in chosen:
                    pair[i, j] += 1
        return pair

    np.testing.assert_array_equal(
        coactivation_pair_counts(trace, 11, "decoder"), brute(trace.layer(11, "decoder"))
    )
    total = sum(brute(r) for r in trace.layers)
    np.testing.assert_array_equal(coactivation_pair_counts(trace), total)  # every layer: all have E experts
    frame = layer_coactivation_frame(trace, 3, "mlp")
    assert set(frame["layer"]) == {3} and len(frame) == E * E
    pair = brute(trace.layer(3, "mlp"))
    np.testing.assert_array_equal(frame["pair_count"], pair.reshape(-1))
    used = np.diag(pair)
    with np.errstate(invalid="ignore", divide="ignore"):
        np.testing.assert_allclose(frame["coactivation"], (pair / used[:, None]).reshape(-1), equal_nan=True)


def test_next_layer_transition_frame_follows_tokens_to_the_next_layer_of_the_site(trace):
    got = next_layer_transition_frame(trace, 2, "mlp")
    assert set(got["layer"]) == {2} and set(got["next_layer"]) == {3} and set(got["site"]) == {"mlp"}
    now, ahead = sets(trace.layer(2, "mlp")), sets(trace.layer(3, "mlp"))
    joint = np.zeros((E, E))
    for here, there in zip(now, ahead, strict=True):
        for i in here:
            for j in there:
                joint[i, j] += 1
    np.testing.assert_array_equal(got["count"], joint.reshape(-1))
    top1 = next_layer_transition_frame(trace, 11, "decoder", top1=True)
    assert set(top1["next_layer"]) == {12} and top1["count"].sum() == len(trace.tokens)
    assert next_layer_transition_frame(trace, 3, "mlp").empty  # the site's last MoE layer
    assert next_layer_transition_frame(trace, 12, "decoder").empty


def test_filter_experts_keeps_rows_whose_columns_are_all_shown():
    frame = pd.DataFrame({"expert": [0, 1, 2, 3], "co_expert": [1, 1, 3, 0]})
    assert filter_experts(frame, [1, 3])["expert"].tolist() == [1, 3]
    assert filter_experts(frame, [0, 1, 3], "expert", "co_expert")["expert"].tolist() == [0, 1, 3]
