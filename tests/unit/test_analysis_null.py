"""Statistics that know the sample size: the uniform-routing null of the load indicators and the bootstrap
bands. The sample models' verdicts on short pieces of the held-out slices:
tests/models/test_analysis_on_models.py."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moeviz.analysis.balance import balance_from_counts
from moeviz.analysis.null import (
    INDICATORS,
    at_effective_tokens,
    balance_confidence_frame,
    dead_distribution,
    dead_pvalue,
    effective_tokens,
    entropy_pvalue,
    expert_confidence_frame,
    load_confidence,
    max_count_pvalue,
    min_tokens_to_judge,
    uniform_counts,
)
from tests.support.traces import make_layer, make_trace


def brute_force_counts(tokens: int, k: int, e: int, draws: int, seed: int) -> np.ndarray:
    """[draws, E] loads of uniform routing, one random k-subset per token (the definition)."""
    rng = np.random.default_rng(seed)
    picks = np.argpartition(rng.random((draws, tokens, e)), k - 1, axis=2)[:, :, :k]
    flat = picks.reshape(draws, -1) + (np.arange(draws) * e)[:, None]
    return np.bincount(flat.ravel(), minlength=draws * e).reshape(draws, e)


@pytest.mark.parametrize(("tokens", "k", "e"), [(16, 2, 8), (12, 4, 16), (10, 1, 4)])
def test_null_sampler_and_exact_dead_count_match_the_definition(tokens, k, e):
    draws = 8_000
    brute = brute_force_counts(tokens, k, e, draws, seed=1)
    fast = uniform_counts(tokens, k, e, draws, seed=2)
    assert (fast.sum(axis=1) == tokens * k).all() and fast.max() <= tokens
    exact = dead_distribution(tokens, k, e)
    assert exact.sum() == pytest.approx(1.0)
    for sample in (brute, fast):
        observed = np.bincount((sample == 0).sum(axis=1), minlength=e + 1) / draws
        assert (np.abs(observed[:3] - exact[:3]) <= 4 * np.sqrt(exact[:3] / draws) + 1e-3).all()
    # max count: the sampler matches the definition, and the union bound is an upper bound (and tight)
    for m in (int(np.quantile(brute.max(axis=1), 0.99)), int(np.quantile(brute.max(axis=1), 0.999))):
        p_brute = (brute.max(axis=1) >= m).mean()
        noise = 4 * math.sqrt(2 * p_brute * (1 - p_brute) / draws) + 1e-3
        assert (fast.max(axis=1) >= m).mean() == pytest.approx(p_brute, abs=noise)
        assert p_brute - noise <= max_count_pvalue(m, tokens, k, e) <= 1.3 * p_brute + noise


def test_exact_extremes():
    # all tokens on the same k-set: P = C(E, k)^(1 − T)
    assert dead_pvalue(6, 5, 2, 8) == pytest.approx(28.0**-4)
    assert dead_pvalue(0, 5, 2, 8) == 1.0
    assert max_count_pvalue(10, 10, 1, 2) == pytest.approx(2 * 0.5**10)
    # total collapse has p = C(E, k)^(1 − T): significant from T = 1 + log(1/α) / log C(E, k) (interpolated)
    assert min_tokens_to_judge(2, 8, 0.01) == pytest.approx(1 + math.log(100) / math.log(28))
    assert min_tokens_to_judge(1, 2, 0.01 / 12) == pytest.approx(1 + math.log2(1200))
    assert min_tokens_to_judge(8, 8, 0.01) == 1  # every expert is always used: nothing to judge
    assert effective_tokens([100], 0.25) == pytest.approx(100 / 25.75)
    assert effective_tokens([1, 1, 0], 0.25) == 2 and effective_tokens([10, 10], 0.0) == 20
    assert at_effective_tokens(lambda n: 0.5**n, 2.5) == pytest.approx(0.5**2.5)


def test_entropy_pvalue_is_calibrated_under_the_null():
    tokens, k, e = 24, 2, 8
    counts = uniform_counts(tokens, k, e, 3000, seed=99)  # other draws than the null's own
    c = counts / counts.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -np.where(c > 0, c * np.log(c), 0).sum(axis=1) / math.log(e)
    p = np.array([entropy_pvalue(x, tokens, k, e) for x in h])
    for level in (0.01, 0.05, 0.2):
        assert (p < level).mean() <= level * 1.3 + 0.003
        assert (p < level).mean() >= level * 0.6
    # far beyond every null draw: the gamma tail, not the Monte-Carlo floor of 1/4001
    assert entropy_pvalue(0.5, 200, 2, 8) < 1e-9
    assert entropy_pvalue(1.0, 200, 2, 8) == 1.0


def _coverage(layers_and_truth, level: float) -> tuple[float, float]:
    share_hits, entropy_hits = [], []
    for seed, (layer, f) in enumerate(layers_and_truth):
        band = load_confidence(layer, level=level, draws=300, seed=seed)
        share_hits.append((band.share_low <= f) & (f <= band.share_high))
        _, low, high = band.indicators["max_share"]
        entropy_hits.append(low <= f.max() <= high)
    return float(np.mean(share_hits)), float(np.mean(entropy_hits))


def test_bootstrap_bands_cover_a_known_load_at_the_nominal_rate():
    rng = np.random.default_rng(0)
    f = np.array([0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.05, 0.02])  # top-1: share = choice probability
    top1 = [(make_layer(rng.choice(8, size=400, p=f), 8), f) for _ in range(100)]
    share_cover, max_cover = _coverage(top1, 0.9)
    assert 0.86 <= share_cover <= 0.94 and max_cover >= 0.8
    # top-2 from a known distribution over pairs: share_e = P(e in pair) / 2
    pairs = np.array([(0, 1), (0, 2), (1, 3), (2, 3), (4, 5), (6, 7)])
    q = np.array([0.3, 0.2, 0.2, 0.1, 0.1, 0.1])
    truth = np.zeros(8)
    for (a, b), w in zip(pairs, q, strict=True):
        truth[[a, b]] += w / 2
    top2 = [(make_layer(pairs[rng.choice(6, size=300, p=q)], 8), truth) for _ in range(60)]
    share_cover, _ = _coverage(top2, 0.8)
    assert 0.74 <= share_cover <= 0.86


def test_confidence_frames_and_edge_cases():
    layer = make_layer([0] * 30 + [1] * 10, 4, layer=2)
    band = load_confidence(layer, level=0.9, draws=200, seed=0)
    assert set(band.indicators) == set(INDICATORS)
    assert band.share.tolist() == [0.75, 0.25, 0.0, 0.0]
    assert (band.share_low <= band.share).all() and (band.share <= band.share_high).all()
    assert band.share_low[2] == band.share_high[2] == 0.0  # a dead expert stays dead in every resample
    value, low, high = band.indicators["dead_fraction"]
    assert value == 0.5 and low <= value <= high
    assert load_confidence(layer, draws=200, seed=0).share_low.tolist() == band.share_low.tolist()
    trace = make_trace([layer, make_layer([[0, 1], [2, 3], [-1, 1]], 4, layer=3)])
    experts = expert_confidence_frame(trace, draws=100)
    assert experts.shape == (8, 6) and experts["layer"].tolist() == [2] * 4 + [3] * 4
    balance = balance_confidence_frame(trace, draws=100)
    assert balance.shape == (8, 7) and set(balance["indicator"]) == set(INDICATORS)
    empty = load_confidence(make_layer(np.zeros((0, 2)), 4), draws=50)
    assert np.isnan(empty.share).all() and np.isnan(empty.indicators["max_share"][1])
    with pytest.raises(ValueError, match="level"):
        load_confidence(layer, level=1.5)


def test_bootstrap_indicators_are_balance_from_counts():
    """The bands' observed values are `balance_from_counts`'s (one implementation, n = 1 its case), the
    degenerate layers included: no token (T = 0, dead fraction NaN, not 1) and every slot dropped."""
    layers = [
        make_layer([0] * 30 + [1] * 10, 4),
        make_layer([[0, 1], [2, 3], [-1, 1]], 4),
        make_layer(np.zeros((0, 2)), 4),
        make_layer(np.full((3, 2), -1), 4),
    ]
    for layer in layers:
        band = load_confidence(layer, draws=20, seed=0)
        counts = np.bincount(layer.experts[layer.experts >= 0], minlength=4)
        stats = balance_from_counts(counts, len(layer.experts), layer.k, int((layer.experts < 0).sum()))
        for name in INDICATORS:
            want = getattr(stats, name)
            got = band.indicators[name][0]
            assert (math.isnan(got) and math.isnan(want)) or got == want, (name, got, want)
    assert math.isnan(load_confidence(layers[2], draws=5).indicators["dead_fraction"][0])


# ---- the sample models on short pieces of the held-out slices ----------------------------------------------
