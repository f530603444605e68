"""Checkpoint comparison: router saturation, overlap and expert drift between synthetic traces of the same
tokens. On real captures: tests/models/test_analysis_on_models.py."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings

from moeviz.analysis.compare import (
    expert_drift_frame,
    match_tokens,
    routing_agreement_frame,
    saturation_timeline,
)
from tests.support.traces import build_case, make_trace, random_sets, routing_cases


def test_trace_against_itself_is_saturated():
    rng = np.random.default_rng(0)
    trace = make_trace([random_sets(rng, 50, 8, 2), random_sets(rng, 50, 8, 2)], 8, seq_lengths=[20, 30])
    frame = routing_agreement_frame(trace, trace)
    assert frame[["saturation_topk", "saturation_top1", "jaccard"]].to_numpy().tolist() == [[1, 1, 1]] * 2
    assert frame["tokens"].tolist() == [50, 50]
    drift = expert_drift_frame(trace, trace)
    assert (drift["drift"].dropna() == 0).all() and (drift["load_change"] == 0).all()


def test_saturation_known_answers():
    # Final: token t has {a_t, b_t}. Checkpoint: first half identical; second half keeps only a_t (as its
    # second choice) → saturation 0.75, top-1 0.5, Jaccard (1 + 1/3) / 2.
    final = np.array([[0, 1], [2, 3], [4, 5], [6, 7]] * 5)
    ckpt = final.copy()
    ckpt[10:] = np.stack([(final[10:, 1] + 2) % 8, final[10:, 0]], axis=1)
    assert all(len(set(f) & set(c)) == 1 for f, c in zip(final[10:], ckpt[10:], strict=True))
    a, b = make_trace([ckpt], 8), make_trace([final], 8)
    row = routing_agreement_frame(a, b).iloc[0]
    assert row["saturation_topk"] == 0.75 and row["saturation_top1"] == 0.5
    assert row["jaccard"] == pytest.approx((1 + 1 / 3) / 2)
    timeline = saturation_timeline([a, a, b], names=["1%", "10%", "final"])
    assert list(timeline.columns) == ["checkpoint", "layer", "site", "saturation_topk", "saturation_top1"]
    assert timeline["checkpoint"].tolist() == ["1%", "10%", "final"]
    assert timeline["saturation_topk"].tolist() == [0.75, 0.75, 1.0]
    explicit = saturation_timeline([a], final=b)
    assert explicit["checkpoint"].tolist() == [0] and explicit["saturation_top1"].tolist() == [0.5]


def test_saturation_with_capacity_drops():
    final = np.array([[0, 1], [2, 3]])
    ckpt = np.array([[0, -1], [-1, -1]])  # capacity dropped slots
    row = routing_agreement_frame(make_trace([ckpt], 4), make_trace([final], 4)).iloc[0]
    assert row["saturation_topk"] == 0.25 and row["saturation_top1"] == 0.5
    assert row["jaccard"] == pytest.approx(0.25)
    # Normalised by what the final dispatched: 1/1, 0/1, 1 (both dropped), 0 (final dropped, ckpt not).
    final = np.array([[0, -1], [2, -1], [-1, -1], [-1, -1]])
    ckpt = np.array([[0, 1], [1, 3], [-1, -1], [1, -1]])
    row = routing_agreement_frame(make_trace([ckpt], 4), make_trace([final], 4)).iloc[0]
    assert row["saturation_topk"] == 0.5
    dropped = make_trace([final], 4)
    assert routing_agreement_frame(dropped, dropped)["saturation_topk"].iloc[0] == 1.0


def test_tokens_are_matched_by_position_not_by_row():
    rng = np.random.default_rng(1)
    experts = random_sets(rng, 30, 8, 2)
    a = make_trace([experts], 8, seq_lengths=[10, 20])
    # b: the same tokens, token table in another row order, layer rows in yet another order.
    perm = rng.permutation(30)
    b = make_trace([experts], 8, seq_lengths=[10, 20])
    b.tokens = a.tokens.iloc[perm].reset_index(drop=True)
    inverse = np.argsort(perm)  # new row of old row r
    layer_order = rng.permutation(30)
    b.layers[0].token_rows = inverse[layer_order]
    b.layers[0].experts = experts[layer_order]
    np.testing.assert_array_equal(match_tokens(a, b), inverse)
    assert routing_agreement_frame(a, b)["saturation_topk"].iloc[0] == 1.0
    assert routing_agreement_frame(b, a)["saturation_top1"].iloc[0] == 1.0


def test_different_tokens_raise():
    rng = np.random.default_rng(2)
    experts = random_sets(rng, 12, 8, 2)
    a = make_trace([experts], 8, seq_lengths=[6, 6])  # token ids 0 … 11
    b = make_trace([experts], 8, seq_lengths=[6, 6])
    b.tokens.loc[8, "token_id"] = 7
    with pytest.raises(ValueError, match=r"\('input', 1, 2\) the token_id is 8 in the first and 7"):
        routing_agreement_frame(a, b)
    c = make_trace([experts[:10]], 8, seq_lengths=[5, 5])
    with pytest.raises(ValueError, match="different tokens"):
        saturation_timeline([a, c])
    d = make_trace([experts], 8, seq_lengths=[4, 8])  # same ids, split differently
    with pytest.raises(ValueError, match="the seq is"):
        expert_drift_frame(a, d)
    e = make_trace([experts], 8, seq_lengths=[6, 6], site="other")
    with pytest.raises(ValueError, match="no MoE layer in common"):
        routing_agreement_frame(a, e)


def test_expert_drift_known_answer():
    a = np.array([[0, 1], [0, 2], [1, 2], [0, 1]])
    b = np.array([[0, 1], [1, 2], [1, 2], [3, 1]])
    drift = expert_drift_frame(make_trace([a], 4), make_trace([b], 4)).set_index("expert")
    # Expert 0: tokens {0, 1, 3} → {0}; expert 1: {0, 2, 3} → {0, 1, 2, 3}; 2: {1, 2} → {1, 2}; 3: {} → {3}.
    assert drift["load_a"].tolist() == [3, 3, 2, 0] and drift["load_b"].tolist() == [1, 4, 2, 1]
    assert drift["load_change"].tolist() == [-2, 1, 0, 1]
    np.testing.assert_allclose(drift["jaccard"], [1 / 3, 3 / 4, 1, 0])
    np.testing.assert_allclose(drift["drift"], [2 / 3, 1 / 4, 0, 1])
    np.testing.assert_allclose(drift["retained"].iloc[:3], [1 / 3, 1, 1])
    assert np.isnan(drift["retained"].iloc[3])
    np.testing.assert_allclose(drift["share_a"], [3 / 8, 3 / 8, 2 / 8, 0])


@settings(max_examples=60, deadline=None)
@given(routing_cases(), routing_cases())
def test_saturation_properties(case_a, case_b):
    ea, e = build_case(case_a)
    eb, _ = build_case((case_b[0], len(ea), e, ea.shape[1], case_b[4]))
    a, b = make_trace([ea], e), make_trace([eb], e)
    row = routing_agreement_frame(a, b).iloc[0]
    for name in ("saturation_topk", "saturation_top1", "jaccard"):
        assert 0.0 <= row[name] <= 1.0
    # Brute force.
    per_token = []
    for p, q in zip(ea.tolist(), eb.tolist(), strict=True):
        sp, sq = {x for x in p if x >= 0}, {x for x in q if x >= 0}
        per_token.append(len(sp & sq) / len(sq) if sq else float(not sp))
    assert row["saturation_topk"] == pytest.approx(np.mean(per_token))
    if (eb >= 0).all():  # OLMoE's / k
        assert row["saturation_topk"] == pytest.approx(
            np.mean([len(set(p) & set(q)) for p, q in zip(ea.tolist(), eb.tolist(), strict=True)])
            / eb.shape[1]
        )
    assert routing_agreement_frame(b, b)[["saturation_topk", "saturation_top1", "jaccard"]].eq(1).all(None)
    drift = expert_drift_frame(a, b)
    assert drift["drift"].dropna().between(0, 1).all()
