"""Temporal and cross-layer structure: known answers on constructed routing, brute-force counts,
closed-form baselines against Monte-Carlo, and properties. On real captures:
tests/models/test_analysis_on_models.py."""

from __future__ import annotations

from collections import Counter
from math import comb

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings

from moeviz.analysis import structure
from moeviz.analysis.structure import (
    coactivation_frame,
    coactivation_matrix,
    next_token_rows,
    path_frame,
    repetition_frame,
    transition_frame,
    transition_matrix,
    uniform_repetition_baselines,
)
from tests.support.traces import build_case, make_layer, make_trace, random_sets, routing_cases


# ---- repetition -------------------------------------------------------------------------------------------
def test_closed_form_baselines_match_monte_carlo():
    u1, uo = uniform_repetition_baselines(8, 2)
    assert u1 == 0.125
    assert uo == pytest.approx(1 - comb(6, 2) / comb(8, 2)) and uo == pytest.approx(0.4643, abs=1e-4)
    rng = np.random.default_rng(1)
    a, b = random_sets(rng, 200_000, 8, 2), random_sets(rng, 200_000, 8, 2)
    assert (a[:, 0] == b[:, 0]).mean() == pytest.approx(0.125, abs=0.004)
    overlap = (a[:, :, None] == b[:, None, :]).any(axis=(1, 2)).mean()
    assert overlap == pytest.approx(uo, abs=0.005)
    # k ≥ E/2: two sets must meet.
    assert uniform_repetition_baselines(4, 3)[1] == 1.0


def test_repetition_known_sequences():
    same = np.tile([[3, 5]], (10, 1))
    alternating = np.array([[0, 1], [2, 3]] * 5)
    frame = repetition_frame(make_trace([same, alternating], 8, seq_lengths=[4, 6]))
    assert frame["top1_repeat"].tolist() == [1.0, 0.0]
    assert frame["overlap_repeat"].tolist() == [1.0, 0.0]
    assert frame["pairs"].tolist() == [3 + 5, 3 + 5]  # never across the two sequences
    assert frame["top1_uniform"].iloc[0] == 0.125


def test_repetition_never_crosses_sequences_streams_or_gaps():
    # Within each sequence the top-1 alternates; each boundary repeats the expert.
    experts = np.array([[0, 1], [2, 3], [2, 3], [0, 1], [0, 1], [2, 3]])
    trace = make_trace([experts], 8, seq_lengths=[2, 2, 2])
    assert repetition_frame(trace)["top1_repeat"].iloc[0] == 0.0
    # Same tokens in one sequence, but a position gap (padding is never in the table) and a stream change.
    trace.tokens["seq"] = 0
    trace.tokens["pos"] = [0, 1, 3, 4, 5, 6]
    trace.tokens["stream"] = ["input"] * 4 + ["decoder"] * 2
    trace.tokens.loc[4:, "pos"] = [0, 1]
    frame = repetition_frame(trace)
    assert frame["pairs"].iloc[0] == 3 and frame["top1_repeat"].iloc[0] == 0.0
    assert next_token_rows(trace.tokens).tolist() == [1, -1, 3, -1, 5, -1]
    # Positions that continue across sequences (e.g. windows of one document) still do not chain.
    trace.tokens["stream"] = "input"
    trace.tokens["seq"] = [0, 0, 1, 1, 2, 2]
    trace.tokens["pos"] = [0, 1, 2, 3, 4, 5]
    assert next_token_rows(trace.tokens).tolist() == [1, -1, 3, -1, 5, -1]
    assert repetition_frame(trace)["top1_repeat"].iloc[0] == 0.0


def test_repetition_order_of_token_table_and_layer_rows_does_not_matter():
    rng = np.random.default_rng(0)
    experts = random_sets(rng, 40, 8, 2)
    trace = make_trace([experts], 8, seq_lengths=[15, 25])
    base = repetition_frame(trace)
    perm = rng.permutation(40)
    shuffled = make_trace([experts[perm]], 8, token_rows=[perm], seq_lengths=[15, 25])
    pd.testing.assert_frame_equal(base, repetition_frame(shuffled))


def test_repetition_brute_force_and_load_baselines_on_skewed_routing():
    rng = np.random.default_rng(2)
    p = np.array([0.4, 0.2, 0.1, 0.1, 0.05, 0.05, 0.05, 0.05])
    experts = random_sets(rng, 120, 8, 2, p)
    experts[5, 1] = -1  # a dropped slot
    experts[9] = -1  # a token with every slot dropped
    trace = make_trace([experts], 8, seq_lengths=[50, 70])
    row = repetition_frame(trace, shuffles=400, seed=3).iloc[0]
    # Brute force over the pairs and over all distinct pairs of tokens.
    sets = [set(x for x in r if x >= 0) for r in experts.tolist()]
    top = experts[:, 0].tolist()
    pairs = [(t, t + 1) for t in range(119) if t != 49]
    top_pairs = [(a, b) for a, b in pairs if top[a] >= 0 and top[b] >= 0]
    assert row["top1_pairs"] == len(top_pairs)
    assert row["top1_repeat"] == pytest.approx(np.mean([top[a] == top[b] for a, b in top_pairs]))
    assert row["overlap_repeat"] == pytest.approx(np.mean([bool(sets[a] & sets[b]) for a, b in pairs]))
    everyone = [(a, b) for a in range(120) for b in range(120) if a != b]
    valid = [(a, b) for a, b in everyone if top[a] >= 0 and top[b] >= 0]
    assert row["top1_load"] == pytest.approx(np.mean([top[a] == top[b] for a, b in valid]))
    assert row["overlap_load"] == pytest.approx(np.mean([bool(sets[a] & sets[b]) for a, b in everyone]))
    assert row["overlap_load_method"] == "exact"
    # The skew raises chance repetition above the uniform level, and real shuffles agree with it.
    assert row["top1_load"] > 0.125 + 0.05 and row["overlap_load"] > row["overlap_uniform"]
    assert row["top1_shuffle_mean"] == pytest.approx(row["top1_load"], abs=4 * row["top1_shuffle_std"] / 20)
    assert row["overlap_shuffle_mean"] == pytest.approx(
        row["overlap_load"], abs=4 * row["overlap_shuffle_std"] / 20
    )


def test_sampled_overlap_baseline_agrees_with_exact(monkeypatch):
    rng = np.random.default_rng(4)
    experts = random_sets(rng, 3000, 16, 3, rng.dirichlet(np.ones(16)))
    trace = make_trace([experts], 16)
    exact = repetition_frame(trace).iloc[0]
    monkeypatch.setattr(structure, "_MAX_EXACT_SETS", 0)
    sampled = repetition_frame(trace).iloc[0]
    assert (exact["overlap_load_method"], sampled["overlap_load_method"]) == ("exact", "sampled")
    assert sampled["overlap_load"] == pytest.approx(exact["overlap_load"], abs=0.006)


def test_uniform_random_routing_repeats_at_chance():
    rng = np.random.default_rng(5)
    trace = make_trace([random_sets(rng, 40_000, 8, 2)], 8, seq_lengths=[400] * 100)
    row = repetition_frame(trace).iloc[0]
    assert row["top1_repeat"] == pytest.approx(0.125, abs=0.006)
    assert row["overlap_repeat"] == pytest.approx(1 - 15 / 28, abs=0.008)
    assert row["top1_load"] == pytest.approx(0.125, abs=0.002)
    assert row["overlap_load"] == pytest.approx(1 - 15 / 28, abs=0.003)


# ---- co-activation ----------------------------------------------------------------------------------------
def test_coactivation_known_pattern():
    # 0 & 1 always together; 2 & 3 together half the time 2 (or 3) is used.
    experts = np.array([[0, 1]] * 4 + [[2, 3]] * 2 + [[2, 4]] * 2 + [[3, 5]] * 2)
    expected = np.array(
        [
            [1, 1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [0, 0, 1, 0.5, 0.5, 0],
            [0, 0, 0.5, 1, 0, 0.5],
            [0, 0, 1, 0, 1, 0],
            [0, 0, 0, 1, 0, 1],
        ]
    )
    trace = make_trace([experts], 6)
    np.testing.assert_array_equal(coactivation_matrix(trace.layers[0]), expected)
    frame = coactivation_frame(trace)
    assert len(frame) == 36 and set(frame["variant"]) == {"all_pairs"}
    pair = frame.set_index(["expert", "co_expert"])
    assert pair.loc[(2, 3), "pair_count"] == 2 and pair.loc[(2, 3), "expert_count"] == 4
    # With k = 2 every pair is rank-adjacent.
    np.testing.assert_array_equal(coactivation_matrix(trace.layers[0], adjacent_only=True), expected)


def test_coactivation_rank_adjacent_variant_skips_non_neighbours():
    experts = np.array([[0, 1, 2], [0, 1, 2], [3, 0, 1], [-1, -1, -1]])
    routing = make_layer(experts, 5)
    full = coactivation_matrix(routing)
    adjacent = coactivation_matrix(routing, adjacent_only=True)
    assert full[0, 2] == pytest.approx(2 / 3) and adjacent[0, 2] == 0  # 0 and 2 are never neighbours
    assert adjacent[2, 1] == 1 and adjacent[3, 0] == 1 and adjacent[0, 3] == pytest.approx(1 / 3)
    assert adjacent[0, 1] == 1 and full[1, 0] == 1
    assert np.isnan(full[4]).all() and np.isnan(adjacent[4]).all()  # expert 4 unused
    assert coactivation_frame(make_trace([experts], 5), adjacent_only=True)["variant"].iloc[0] == (
        "rank_adjacent"
    )


@settings(max_examples=60, deadline=None)
@given(routing_cases())
def test_coactivation_properties(case):
    experts, e = build_case(case)
    routing = make_layer(experts, e)
    for adjacent in (False, True):
        matrix = coactivation_matrix(routing, adjacent_only=adjacent)
        used = np.isin(np.arange(e), experts[experts >= 0])
        np.testing.assert_array_equal(np.diag(matrix)[used], 1.0)
        assert np.isnan(matrix[~used]).all()
        assert np.nanmax(matrix, initial=0) <= 1.0 and np.nanmin(matrix, initial=0) >= 0.0
        # Relabelling the experts permutes the matrix consistently.
        perm = np.random.default_rng(case[0]).permutation(e)
        relabelled = np.where(experts >= 0, perm[np.maximum(experts, 0)], -1)
        m2 = coactivation_matrix(make_layer(relabelled, e), adjacent_only=adjacent)
        np.testing.assert_array_equal(m2[np.ix_(perm, perm)], matrix)


# ---- transitions and paths --------------------------------------------------------------------------------
def brute_transitions(src: np.ndarray, dst: np.ndarray, e_src: int, e_dst: int) -> np.ndarray:
    joint, count = Counter(), Counter()
    for a, b in zip(src.tolist(), dst.tolist(), strict=True):
        for i in {x for x in a if x >= 0}:
            count[i] += 1
            for j in {x for x in b if x >= 0}:
                joint[i, j] += 1
    out = np.full((e_src, e_dst), np.nan)
    for i in count:
        out[i] = [joint[i, j] / count[i] for j in range(e_dst)]
    return out


def test_transitions_match_brute_force_and_rows_sum_to_k_next():
    rng = np.random.default_rng(6)
    n = 300
    l0, l1 = random_sets(rng, n, 8, 2), random_sets(rng, n, 8, 2)
    # Layer 1 routes its tokens in another order, and not the last 20: tokens are matched by row.
    perm = rng.permutation(n)[: n - 20]
    trace = make_trace([l0, l1[perm]], 8, token_rows=[np.arange(n), perm])
    matrix = transition_matrix(trace.layers[0], trace.layers[1], n)
    keep = np.sort(perm)
    np.testing.assert_allclose(matrix, brute_transitions(l0[keep], l1[keep], 8, 8))
    np.testing.assert_allclose(matrix.sum(axis=1), 2.0)
    top1 = transition_matrix(trace.layers[0], trace.layers[1], n, top1=True)
    np.testing.assert_allclose(top1, brute_transitions(l0[keep, :1], l1[keep, :1], 8, 8))
    np.testing.assert_allclose(np.nansum(top1, axis=1)[np.isin(np.arange(8), l0[keep, 0])], 1.0)
    frame = transition_frame(trace)
    assert len(frame) == 64 and frame[["layer", "next_layer"]].drop_duplicates().values.tolist() == [[0, 1]]
    wide = frame.pivot(index="expert", columns="next_expert", values="probability").to_numpy()
    np.testing.assert_allclose(wide, matrix)
    assert frame["count"].sum() == 2 * 2 * len(keep)


def test_transitions_only_between_consecutive_layers_of_a_site():
    rng = np.random.default_rng(7)
    trace = make_trace([random_sets(rng, 50, 4, 1) for _ in range(3)], 4)
    trace.layers[1].layer, trace.layers[2].layer = 5, 3  # unordered, MoE every other layer
    pairs = transition_frame(trace, top1=True)[["layer", "next_layer"]].drop_duplicates().values.tolist()
    assert pairs == [[0, 3], [3, 5]]


def test_top1_paths_known_answer():
    l0 = np.array([[0], [0], [0], [1], [2]])
    l1 = np.array([[1], [1], [1], [1], [3]])
    l2 = np.array([[2], [2], [3], [2], [3]])
    trace = make_trace([l0, l1, l2], 4)
    frame = path_frame(trace, top_n=2)
    assert frame["path"].iloc[0] == (0, 1, 2) and len(frame) == 2  # then one of the four single paths
    assert frame["count"].tolist() == [2, 1] and frame["share"].iloc[0] == pytest.approx(0.4)
    assert frame["label"].iloc[0] == "0→1→2" and frame["layers"].iloc[0] == (0, 1, 2)
    # Only tokens routed by every layer of the window count (layer 2 skips token 0, in another row order).
    partial = make_trace([l0, l1, l2[[4, 3, 2, 1]]], 4, token_rows=[range(5), range(5), [4, 3, 2, 1]])
    frame = path_frame(partial)
    assert frame["tokens"].iloc[0] == 4 and frame["count"].sum() == 4
    assert sorted(frame["path"]) == [(0, 1, 2), (0, 1, 3), (1, 1, 2), (2, 3, 3)]
    window = path_frame(trace, layers=[0, 1])
    assert window["path"].tolist() == [(0, 1), (1, 1), (2, 3)] and window["count"].tolist() == [3, 1, 1]
