"""Load/balance, balancing losses and per-token confidence on synthetic routing, against hand computations
and references. On real captures: tests/models/test_analysis_on_models.py."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from moeviz.analysis import (
    balance_frame,
    balance_stats,
    confidence_frame,
    ep_balancedness_over_layers,
    expert_balance_frame,
    loss_frame,
    loss_stats,
    seq_aux_loss,
)
from moeviz.analysis.balance import (
    balance_from_counts,
    contiguous_device_load,
    ep_balancedness,
    gini,
    jain_index,
    trace_device_load,
)
from moeviz.analysis.confidence import confidence_summary_frame, layer_confidence, topk_margin
from moeviz.analysis.losses import (
    aux_loss_top1,
    aux_loss_topk,
    bias_stats,
    router_probs,
    z_loss,
)
from moeviz.scoring import scores_from_logits
from tests.support.traces import make_layer, make_trace, random_layer


def logits_of(probs) -> np.ndarray:
    """Logits whose softmax is `probs` (rows summing to 1)."""
    return np.log(np.asarray(probs, dtype=np.float64)).astype(np.float32)


# ---- load and balance: hand-computed cases ------------------------------------------------------------
def test_uniform_routing_is_perfectly_balanced():
    layer = make_layer(np.arange(8) % 4, 4)  # 8 tokens, top-1, 2 per expert, uniform probabilities
    s = balance_stats(layer, devices=2)
    assert s.counts.tolist() == [2, 2, 2, 2]
    assert s.load_entropy == pytest.approx(1.0)
    assert s.effective_experts == pytest.approx(4.0)
    assert s.jain == pytest.approx(1.0)
    assert s.max_vio == 0.0 and s.cv == 0.0 and s.gini == 0.0
    assert s.max_share == 0.25 and s.dead_experts == 0 and s.dead_fraction == 0.0
    assert s.utilisation.tolist() == [1.0, 1.0, 1.0, 1.0]
    assert s.ep_balancedness == 1.0
    losses = loss_stats(layer)
    assert losses.aux_loss_top1 == pytest.approx(1.0)  # uniform P: E Σ f/E = Σ f = 1
    assert losses.aux_loss_dispatched == pytest.approx(1.0)
    assert losses.z_loss == pytest.approx(math.log(4) ** 2)
    two = make_layer(np.stack([np.arange(8) % 4, (np.arange(8) + 1) % 4], 1), 4)
    assert loss_stats(two).aux_loss_topk == pytest.approx(2.0)  # top-k form: Σ f = k


def test_every_token_to_one_expert():
    layer = make_layer(np.full(8, 2), 4)
    s = balance_stats(layer, devices=2)
    assert s.counts.tolist() == [0, 0, 8, 0]
    assert s.max_share == 1.0
    assert s.dead_experts == 3 and s.dead_fraction == 0.75
    assert s.load_entropy == 0.0 and s.effective_experts == 1.0
    assert s.jain == pytest.approx(0.25)  # 1/E
    assert s.gini == pytest.approx(0.75)  # (E−1)/E
    assert s.max_vio == pytest.approx(3.0)  # 8 / 2 − 1
    assert s.cv == pytest.approx(math.sqrt(3.0))  # std([0,0,8,0]) = √12, mean 2
    assert s.ep_balancedness == pytest.approx(0.5)  # devices carry [0, 8]
    assert balance_stats(layer, devices=4).ep_balancedness == pytest.approx(0.25)


def test_one_dead_expert_top2():
    pairs = [(0, 1), (1, 2), (0, 2), (0, 1), (1, 2), (0, 2)]
    s = balance_stats(make_layer(pairs, 4))
    assert s.counts.tolist() == [4, 4, 4, 0]
    assert s.dead_experts == 1 and s.dead_fraction == 0.25
    assert s.max_share == pytest.approx(4 / 12)
    np.testing.assert_allclose(s.utilisation, [4 / 3, 4 / 3, 4 / 3, 0])
    assert s.max_vio == pytest.approx(1 / 3)
    assert s.load_entropy == pytest.approx(math.log(3) / math.log(4))
    assert s.jain == pytest.approx(144 / (4 * 48))
    assert s.gini == pytest.approx(24 / 96)  # Σ_ij |c_i − c_j| = 24 over 2·E·Σc = 96
    assert s.cv == pytest.approx(math.sqrt(3) / 3)


def test_dropped_slots_count_for_no_expert():
    layer = make_layer([[0, 1], [0, -1], [2, 3], [0, -1]], 4)
    s = balance_stats(layer)
    assert s.counts.tolist() == [3, 1, 1, 1] and s.dropped == 2
    assert s.dropped_fraction == pytest.approx(0.25)
    assert s.max_share == pytest.approx(3 / 8)  # f = c / (kT), the dropped slots stay in kT
    np.testing.assert_allclose(s.utilisation, [1.5, 0.5, 0.5, 0.5])
    assert s.dead_experts == 0
    # Shares are of all kT slots: they sum to 1 − dropped fraction.
    frame = expert_balance_frame(make_trace([layer]), devices=2)
    assert frame["share"].sum() == pytest.approx(0.75)
    assert frame["device"].tolist() == [0, 0, 1, 1]
    assert frame["dead"].tolist() == [False] * 4


def test_degenerate_layers_give_nan_without_warnings():
    empty = make_layer(np.zeros((0, 2)), 4)
    all_dropped = make_layer(np.full((3, 1), -1), 4, layer=1)
    trace = make_trace([empty, all_dropped])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = balance_stats(empty, devices=2)
        frame = balance_frame(trace, devices=2)
        losses = loss_frame(trace)
        conf = confidence_frame(trace)
        summary = confidence_summary_frame(trace)
        per_expert = expert_balance_frame(trace)
    assert s.tokens == 0 and s.dead_experts == 0
    for value in (s.max_vio, s.cv, s.gini, s.jain, s.load_entropy, s.max_share, s.dead_fraction):
        assert math.isnan(value)
    assert math.isnan(s.ep_balancedness)
    row = frame.set_index("layer").loc[1]
    assert row["dead_experts"] == 4 and row["dead_fraction"] == 1.0 and row["max_share"] == 0.0
    assert math.isnan(row["load_entropy"]) and math.isnan(row["gini"])
    assert math.isnan(losses.loc[0, "aux_loss_top1"]) and math.isnan(losses.loc[0, "z_loss"])
    assert len(conf) == 3 and conf["dropped"].tolist() == [1, 1, 1]
    assert summary["tokens"].tolist() == [0, 3]
    assert len(per_expert) == 8


def test_ep_balancedness_needs_a_divisor():
    with pytest.raises(ValueError, match="split evenly"):
        contiguous_device_load(np.ones(8), 3)
    with pytest.raises(ValueError, match="split evenly"):
        balance_frame(make_trace([make_layer(np.arange(6) % 6, 6)]), devices=4)
    assert ep_balancedness(contiguous_device_load(np.array([1, 2, 3, 2]), 2)) == pytest.approx(
        4 / 5
    )  # [3, 5]


def test_gini_matches_brute_force_mean_absolute_difference():
    rng = np.random.default_rng(0)
    for _ in range(50):
        c = rng.integers(0, 100, size=rng.integers(1, 20))
        if c.sum() == 0:
            continue
        brute = np.abs(c[:, None] - c[None, :]).sum() / (2 * len(c) ** 2 * c.mean())
        assert gini(c) == pytest.approx(brute, abs=1e-12)


def test_balance_frame_rows_agree_with_the_expert_rows():
    rng = np.random.default_rng(1)
    layers = [random_layer(rng, 50, 8, 2, skew=s) for s in (0.0, 2.0)]
    for i, layer in enumerate(layers):
        layer.layer = i
    trace = make_trace(layers)
    frame = balance_frame(trace, devices=4)
    assert len(frame) == 2 and list(frame["layer"]) == [0, 1]
    experts = expert_balance_frame(trace, devices=4).groupby("layer")
    np.testing.assert_allclose(frame["max_share"], experts["share"].max())
    np.testing.assert_allclose(frame["max_utilisation"], experts["utilisation"].max())
    np.testing.assert_allclose(frame["min_utilisation"], experts["utilisation"].min())
    assert frame["dead_experts"].tolist() == experts["dead"].sum().tolist()
    for layer, row in zip(layers, frame.itertuples(), strict=True):
        share = np.bincount(layer.experts.ravel(), minlength=8) / layer.experts.size
        nz = share[share > 0]
        assert row.load_entropy == pytest.approx(-(nz * np.log(nz)).sum() / np.log(8))


def test_peer_conventions_cv_unbiased_and_gini_megatron():
    counts = np.array([4, 4, 4, 0])
    s = balance_from_counts(counts, tokens=6, top_k=2)
    mean = 3.0
    assert s.cv == pytest.approx(np.sqrt(((counts - mean) ** 2).sum() / 4) / mean)  # population std
    assert s.cv_unbiased == pytest.approx(np.sqrt(((counts - mean) ** 2).sum() / 3) / mean)  # ddof = 1
    assert s.cv_unbiased == pytest.approx(s.cv * math.sqrt(4 / 3))
    assert s.gini == pytest.approx(0.25) and s.gini_megatron == pytest.approx(0.25 - 1 / 4)
    even = balance_from_counts(np.array([3, 3, 3, 3]), tokens=6, top_k=2)
    assert even.cv_unbiased == 0.0 and even.gini_megatron == pytest.approx(-0.25)
    one = balance_from_counts(np.array([5]), tokens=5, top_k=1)
    assert math.isnan(one.cv_unbiased) and one.gini_megatron == pytest.approx(-1.0)
    row = balance_frame(make_trace([make_layer([[0, 1], [1, 2], [0, 2], [0, 1], [1, 2], [0, 2]], 4)]))
    assert row.loc[0, "cv_unbiased"] == pytest.approx(s.cv_unbiased)
    assert row.loc[0, "gini_megatron"] == pytest.approx(s.gini_megatron)


def test_ep_balancedness_over_layers_by_hand():
    # layer 0: devices carry [3, 1] → mean 2, max 3; layer 1: [4, 4] → mean 4, max 4.
    first = make_layer([0, 0, 1, 2], 4)
    second = make_layer([0, 1, 2, 3, 0, 1, 2, 3], 4, layer=1)
    trace = make_trace([first, second])
    assert ep_balancedness_over_layers(trace_device_load(trace, 2)) == pytest.approx((2 + 4) / (3 + 4))
    # not the mean of the per-layer values (2/3 and 1): busy layers weigh more
    per_layer = balance_frame(trace, devices=2)["ep_balancedness"].mean()
    assert per_layer == pytest.approx((2 / 3 + 1) / 2)
    dropped = make_trace([make_layer(np.full((2, 1), -1), 4)])
    assert math.isnan(ep_balancedness_over_layers(trace_device_load(dropped, 2)))
    with pytest.raises(ValueError, match="split evenly"):
        trace_device_load(trace, 3)


# ---- balancing losses --------------------------------------------------------------------------------
def test_aux_loss_hand_computed():
    probs = np.array([[0.8, 0.2], [0.6, 0.4], [0.3, 0.7]], np.float32)
    # f = [2/3, 1/3], P = [1.7/3, 1.3/3]  →  L = 2 (2/3 · 1.7/3 + 1/3 · 1.3/3) = 9.4 / 9
    assert aux_loss_top1(probs) == pytest.approx(9.4 / 9, rel=1e-6)
    assert aux_loss_topk(probs, 2) == pytest.approx(2.0, rel=1e-6)  # k = E: every token includes every e


def _seq_aux_loss_loops(scores, seqs, k):
    """DeepSeek-V3 eq. 17–20 written out with loops: per sequence f_i = E/(kT) Σ_t 1[i ∈ top-k(s_t)],
    P_i = (1/T) Σ_t s_{i,t} / Σ_j s_{j,t}, L = Σ_i f_i P_i; the mean over sequences."""
    e = len(scores[0])
    losses = []
    for seq in sorted(set(seqs)):
        rows = [row for row, s in zip(scores, seqs, strict=True) if s == seq]
        t = len(rows)
        f, p = [0.0] * e, [0.0] * e
        for row in rows:
            for i in sorted(range(e), key=lambda j: -row[j])[:k]:
                f[i] += e / (k * t)
            for i in range(e):
                p[i] += row[i] / sum(row) / t
        losses.append(sum(f[i] * p[i] for i in range(e)))
    return sum(losses) / len(losses)


def test_seq_aux_loss_hand_computed():
    probs = np.array([[0.8, 0.2], [0.6, 0.4], [0.3, 0.7], [0.6, 0.4]], np.float32)
    # seq 0 (T = 2): f = 2/2 · [2, 0] = [2, 0], P = [0.7, 0.3] → 1.4
    # seq 1 (T = 2): f = 2/2 · [1, 1] = [1, 1], P = [0.45, 0.55] → 1.0; mean 1.2
    assert seq_aux_loss(probs, np.array([0, 0, 1, 1]), 1) == pytest.approx(1.2, rel=1e-6)
    # one sequence of all four rows: f = 2/4 · [3, 1], P = [0.575, 0.425] → 0.9750
    assert seq_aux_loss(probs, None, 1) == pytest.approx(1.5 * 0.575 + 0.5 * 0.425, rel=1e-6)
    # perfectly balanced: 1 (α = 1), also for k = 2 of 4
    even = np.full((4, 4), 0.25, np.float32)
    assert seq_aux_loss(even, None, 1, selected=np.arange(4)[:, None]) == pytest.approx(1.0)
    assert seq_aux_loss(even, None, 2, selected=np.array([[0, 1], [2, 3]] * 2)) == pytest.approx(1.0)
    # dropped slots (-1) count for no expert
    assert seq_aux_loss(even, None, selected=np.array([[0], [1], [2], [-1]])) == pytest.approx(0.75)
    assert math.isnan(seq_aux_loss(np.zeros((0, 4), np.float32)))


def test_seq_aux_loss_matches_loops_and_is_in_loss_frame():
    rng = np.random.default_rng(7)
    logits = rng.normal(size=(30, 6)) * 2
    seqs = np.repeat([0, 1, 2], [12, 10, 8])
    for score_fn in ("softmax", "sigmoid"):
        layer = make_layer(np.zeros((30, 2), np.int64), 6, logits, score_fn=score_fn)
        want = _seq_aux_loss_loops(layer.scores.astype(np.float64).tolist(), seqs.tolist(), 2)
        assert seq_aux_loss(router_probs(layer), seqs, 2) == pytest.approx(want, rel=1e-5)
        assert loss_stats(layer, seqs).seq_aux_loss == pytest.approx(want, rel=1e-5)
        trace = make_trace([layer])
        trace.tokens["seq"] = seqs
        assert loss_frame(trace).loc[0, "seq_aux_loss"] == pytest.approx(want, rel=1e-5)


def test_z_loss_matches_logsumexp_and_switch_reference():
    import torch
    from transformers.models.switch_transformers.modeling_switch_transformers import router_z_loss_func

    rng = np.random.default_rng(0)
    logits = (rng.normal(size=(37, 8)) * 30).astype(np.float32)  # large logits: needs the stable form
    expected = float(torch.logsumexp(torch.from_numpy(logits).double(), dim=-1).square().mean())
    assert z_loss(logits) == pytest.approx(expected, rel=1e-5)
    reference = float(router_z_loss_func(torch.from_numpy(logits)[None]))
    assert z_loss(logits) == pytest.approx(reference, rel=1e-5)


def test_sigmoid_router_uses_normalised_scores():
    logits = np.array([[2.0, 0.0, -1.0, -3.0], [0.6, 0.4, -0.5, 1.0]], np.float32)
    layer = make_layer([[0, 1], [3, 0]], 4, logits, score_fn="sigmoid")
    s = 1 / (1 + np.exp(-logits.astype(np.float64)))
    p = s / s.sum(1, keepdims=True)
    np.testing.assert_allclose(router_probs(layer), p, rtol=1e-6)
    f = np.array([2, 1, 0, 1]) / 2
    assert loss_stats(layer).aux_loss_topk == pytest.approx(4 * (f * p.mean(0)).sum(), rel=1e-6)
    conf = layer_confidence(layer)
    np.testing.assert_allclose(conf.entropy, -(p * np.log(p)).sum(1), rtol=1e-5)


def test_megatron_bias_flags():
    assert not bias_stats(np.array([0.5, -0.5, 0.2])).flagged
    wide = bias_stats(np.array([3.0, -3.0, 0.0, 0.0]))
    assert wide.std_flag and not wide.abs_flag
    big = bias_stats(np.array([5.5, 5.5, 5.5]))
    assert big.abs_flag and not big.std_flag and big.std == 0.0 and big.range == 0.0
    assert bias_stats(None) is None


# ---- confidence --------------------------------------------------------------------------------------
THREE_TOKENS = np.array([[0.5, 0.3, 0.15, 0.05], [0.28, 0.26, 0.24, 0.22], [0.1, 0.6, 0.1, 0.2]])


def test_confidence_on_three_hand_made_tokens():
    layer = make_layer([[0, 1], [0, 1], [1, 3]], 4, logits_of(THREE_TOKENS))
    c = layer_confidence(layer)
    np.testing.assert_allclose(
        c.margin, [(0.3 - 0.15) / 0.3, (0.26 - 0.24) / 0.26, (0.2 - 0.1) / 0.2], rtol=1e-5
    )
    entropy = [-sum(p * math.log(p) for p in row) for row in THREE_TOKENS]
    np.testing.assert_allclose(c.entropy, entropy, rtol=1e-5)
    np.testing.assert_allclose(c.entropy_norm, np.array(entropy) / math.log(4), rtol=1e-5)
    np.testing.assert_allclose(c.top1_score, [0.5, 0.28, 0.6], rtol=1e-5)
    assert np.isnan(c.unbiased_overlap).all() and np.isnan(c.margin_selection).all()
    frame = confidence_frame(make_trace([layer]))
    assert list(frame.columns[:11]) == [
        "seq",
        "pos",
        "token",
        "layer",
        "site",
        "entropy",
        "entropy_norm",
        "top1_score",
        "margin",
        "margin_selection",
        "unbiased_overlap",
    ]
    assert frame["token"].tolist() == ["t0", "t1", "t2"] and frame["pos"].tolist() == [0, 1, 2]


def test_confidence_of_a_biased_router():
    bias = np.array([0.0, 0.0, 0.2, 0.0])
    # selection s = p + b: token 0 → {0, 2}; token 1 → {2, 0}; token 2 → {1, 2}
    layer = make_layer([[0, 2], [2, 0], [1, 2]], 4, logits_of(THREE_TOKENS), bias=bias)
    c = layer_confidence(layer)
    # on p the chosen set is not the top-k: min_S p < max_notS p → clipped to 0
    np.testing.assert_allclose(c.margin, [0, 0, 0])
    s = THREE_TOKENS + bias
    expected = [(0.35 - 0.3) / 0.35, (0.28 - 0.26) / 0.28, (0.3 - 0.2) / 0.3]
    np.testing.assert_allclose(c.margin_selection, expected, rtol=1e-4)
    assert s[2, 2] == pytest.approx(0.3)
    # top-2 of p: {0,1}, {0,1}, {1,3}  vs  chosen {0,2}, {2,0}, {1,2}
    np.testing.assert_allclose(c.unbiased_overlap, [0.5, 0.5, 0.5])
    unchanged = make_layer([[0, 1]], 4, logits_of(THREE_TOKENS[:1]), bias=np.zeros(4))
    assert layer_confidence(unchanged).unbiased_overlap.tolist() == [1.0]


def test_dropped_slot_is_refilled_for_the_margin():
    probs = np.array([[0.7, 0.2, 0.1], [0.2, 0.5, 0.3]])
    layer = make_layer([[-1], [1]], 3, logits_of(probs))  # token 0: its top-1 (e0) dropped by capacity
    c = layer_confidence(layer)
    np.testing.assert_allclose(c.margin, [(0.7 - 0.2) / 0.7, (0.5 - 0.3) / 0.5], rtol=1e-5)
    assert c.dropped.tolist() == [1, 0]


def test_margin_edge_cases():
    values = np.array([[0.5, 0.5], [0.7, 0.3]], np.float32)
    assert topk_margin(values, np.array([[0, 1], [0, 1]])).tolist() == [1.0, 1.0]  # k = E
    assert np.isnan(topk_margin(values, np.array([[0, 1], [0, 1]]), empty_outside=None)).all()
    assert np.isnan(topk_margin(values, np.array([[-1], [-1]]))).all()  # nothing selected
    assert topk_margin(values, np.array([[0], [1]])).tolist() == [0.0, 0.0]  # tie; below the best: clipped


# ---- properties --------------------------------------------------------------------------------------
counts_strategy = st.integers(1, 16).flatmap(lambda e: arrays(np.int64, e, elements=st.integers(0, 1000)))


@settings(max_examples=200, deadline=None)
@given(counts_strategy)
def test_balance_metrics_stay_in_range(counts):
    assume(counts.sum() > 0)
    e = len(counts)
    s = balance_from_counts(counts, tokens=int(counts.sum()), top_k=1)
    eps = 1e-9
    assert -eps <= s.load_entropy <= 1 + eps
    assert 1 / e - eps <= s.jain <= 1 + eps
    assert -eps <= s.gini <= (e - 1) / e + eps
    assert 1 - eps <= s.effective_experts <= e + eps
    assert s.max_vio >= -eps and s.cv >= -eps
    assert jain_index(counts) == pytest.approx(s.jain)
    for d in (d for d in range(1, e + 1) if e % d == 0):
        assert 0 < ep_balancedness(contiguous_device_load(counts, d)) <= 1 + eps


SCALARS = ("max_vio", "cv", "gini", "jain", "load_entropy", "effective_experts", "max_share", "dead_fraction")


@settings(max_examples=60, deadline=None)
@given(
    st.integers(2, 12).flatmap(
        lambda e: st.tuples(
            st.just(e),
            st.integers(1, min(e, 3)),
            st.integers(0, 60),
            st.integers(0, 2**32 - 1),
            st.permutations(range(e)),
            st.sampled_from([0.0, 0.2]),
        )
    )
)
def test_load_metrics_invariant_under_relabelling(case):
    e, k, n, seed, perm, drop = case
    perm = np.asarray(perm)
    layer = random_layer(np.random.default_rng(seed), n, e, k, skew=2.0, drop=drop)
    relabelled = make_layer(np.where(layer.experts >= 0, perm[np.maximum(layer.experts, 0)], -1), e)
    a, b = balance_stats(layer), balance_stats(relabelled)
    np.testing.assert_array_equal(b.counts[perm], a.counts)
    for name in SCALARS:
        assert getattr(a, name) == pytest.approx(getattr(b, name), nan_ok=True, rel=1e-12), name


@settings(max_examples=60, deadline=None)
@given(
    st.tuples(st.integers(1, 30), st.integers(2, 8)).flatmap(
        lambda shape: st.tuples(
            arrays(np.float32, shape, elements=st.floats(-8, 8, width=32), unique=True),
            st.permutations(range(shape[1])),
            st.integers(1, shape[1]),
        )
    )
)
def test_aux_loss_invariant_under_consistent_permutation(case):
    logits, perm, k = case
    perm = np.asarray(perm)
    ordered = np.sort(scores_from_logits(logits, "softmax"), axis=1)[:, ::-1]
    # top-k must be unambiguous (no tie in probability across the k-th / (k+1)-th or the 1st / 2nd place)
    for j in {0, k - 1}:
        if j + 1 < logits.shape[1]:
            assume((ordered[:, j] > ordered[:, j + 1]).all())
    permuted = np.empty_like(logits)
    permuted[:, perm] = logits  # expert e becomes expert perm[e]
    probs, probs_p = scores_from_logits(logits, "softmax"), scores_from_logits(permuted, "softmax")
    for top_k in (1, k):
        assert aux_loss_topk(probs, top_k) == pytest.approx(aux_loss_topk(probs_p, top_k), rel=1e-5)
    assert z_loss(logits) == pytest.approx(z_loss(permuted), rel=1e-5)
    entropy = layer_confidence(make_layer(np.zeros((len(logits), 1)), logits.shape[1], logits)).entropy
    entropy_p = layer_confidence(make_layer(np.zeros((len(logits), 1)), logits.shape[1], permuted)).entropy
    np.testing.assert_allclose(entropy, entropy_p, rtol=1e-5, atol=1e-6)
    assert (entropy_p / math.log(logits.shape[1]) <= 1 + 1e-5).all() and (entropy_p >= -1e-6).all()


def test_zero_computation_experts_are_counted_apart():
    """LongCat-style: 4 routed experts and 2 identity experts (ids 4, 5). Hand-derived: 6 tokens × k = 2."""
    import dataclasses

    from moeviz.analysis.balance import balance_stats, expert_counts, routed_counts
    from moeviz.testing.scale_traces import synthetic_trace

    experts = np.array([[0, 4], [1, 5], [0, 1], [4, 5], [2, 0], [1, 4]])  # expert 3 never chosen
    base = synthetic_trace(
        num_experts=6, k=2, n_group=1, topk_group=1, num_blocks=1, first_dense=0, num_tokens=6
    )
    routing = dataclasses.replace(
        base.layers[0], experts=experts, weights=np.full((6, 2), 0.5, np.float32), zero_experts=2
    )
    np.testing.assert_array_equal(expert_counts(routing), [3, 3, 1, 0, 3, 2])
    counts, skipped = routed_counts(routing)
    np.testing.assert_array_equal(counts, [3, 3, 1, 0])
    assert skipped == 5
    stats = balance_stats(routing)
    assert stats.num_experts == 4 and stats.dead_experts == 1  # the identity experts are never "dead"
    assert stats.skipped == 5 and stats.skipped_fraction == 5 / 12
    assert stats.max_share == 3 / 12
