"""What uniform routing of the same number of tokens would show: null distributions of the load indicators,
and bootstrap confidence bands of the observed load.

Null model: each of T tokens picks k distinct experts out of E uniformly at random, independently of the
other tokens (capacity ignored). Under it, for one layer:
- dead count D = #{e : c_e = 0}: exact, from the Markov chain on the number of experts touched so far
  (each token touches a hypergeometric number of new experts), raised to the power T by squaring.
- max count M = max_e c_e: each c_e ~ Binomial(T, k/E), so P(M ≥ m) ≤ E · P(c_1 ≥ m) (union bound: a
  conservative p-value, tight in the tail where it matters).
- normalised load entropy h = H(c/Σc)/log E: Monte-Carlo (fixed seed, cached per (T, k, E)) of the
  deficiency statistic G = 2 Σc (log E − H_nats); p is the share of null draws at least as extreme when
  that share is resolved (≥ 20 draws beyond), otherwise the tail of a gamma distribution with the draws'
  mean and variance (G is ≈ (E−k)/(E−1) · χ²_{E−1} for large T).

Bootstrap bands (`load_confidence`, `expert_confidence_frame`, `balance_confidence_frame`): resample the
layer's tokens with replacement and take percentile intervals of every expert's share f_e = c_e/(kT) and of
the layer's max share, load entropy, dead fraction and cv. Tokens are treated as independent: tokens of one
text are not (a repeated word routes alike), so the bands are, if anything, too narrow for short texts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import pandas as pd

from moeviz.analysis.balance import balance_indicators, expert_counts, load_entropy_nats
from moeviz.trace import LayerRouting, Trace

NULL_DRAWS = 4000  # Monte-Carlo draws of the entropy null
NULL_SEED = 20260
_MIN_HITS = 20  # null draws beyond the observation needed to trust the empirical p-value


# ---- exact: dead experts ----------------------------------------------------------------------------------
@lru_cache(maxsize=256)
def dead_distribution(tokens: int, top_k: int, experts: int) -> np.ndarray:
    """P(D = d) for d = 0..E under uniform routing of `tokens` tokens to `top_k` distinct of `experts`."""
    e, k = experts, min(top_k, experts)
    if tokens <= 0 or k <= 0:
        out = np.zeros(e + 1)
        out[e] = 1.0
        return out
    # step[m, m + j]: a token touches j new experts when m are touched already (hypergeometric)
    step = np.zeros((e + 1, e + 1))
    total = math.comb(e, k)
    for m in range(e + 1):
        for j in range(max(0, k - m), min(k, e - m) + 1):
            step[m, m + j] = math.comb(e - m, j) * math.comb(m, k - j) / total
    state = np.zeros(e + 1)
    state[0] = 1.0
    power, n = step, tokens
    while n:  # state · step^T by squaring
        if n & 1:
            state = state @ power
        n >>= 1
        if n:
            power = power @ power
    touched = np.clip(state, 0.0, None)
    return touched[::-1].copy()  # D = E − touched


def dead_pvalue(dead: int, tokens: int, top_k: int, experts: int) -> float:
    """P(D ≥ dead) under uniform routing (exact)."""
    if dead <= 0:
        return 1.0
    return float(min(1.0, dead_distribution(tokens, top_k, experts)[dead:].sum()))


# ---- union bound: max share -------------------------------------------------------------------------------
def binomial_sf(m: int, n: int, p: float) -> float:
    """P(X ≥ m) for X ~ Binomial(n, p), summed in log space (exact up to rounding)."""
    if m <= 0:
        return 1.0
    if m > n:
        return 0.0
    if p >= 1.0:
        return 1.0
    j = np.arange(m, n + 1, dtype=np.float64)
    log_pmf = (
        math.lgamma(n + 1)
        - np.array([math.lgamma(x + 1) for x in j])
        - np.array([math.lgamma(n - x + 1) for x in j])
        + j * math.log(p)
        + (n - j) * math.log1p(-p)
    )
    top = log_pmf.max()
    return float(min(1.0, math.exp(top) * np.exp(log_pmf - top).sum()))


def max_count_pvalue(max_count: int, tokens: int, top_k: int, experts: int) -> float:
    """Upper bound on P(max_e c_e ≥ max_count) under uniform routing: E · P(Binomial(T, k/E) ≥ max_count)."""
    if experts <= 1:
        return 1.0
    p = min(top_k, experts) / experts
    return float(min(1.0, experts * binomial_sf(int(max_count), int(tokens), p)))


# ---- Monte Carlo: load entropy ----------------------------------------------------------------------------
def uniform_counts(tokens: int, top_k: int, experts: int, draws: int, seed: int) -> np.ndarray:
    """[draws, E] loads of uniform routing: every token picks top_k distinct experts uniformly.

    Exact and independent of T: experts are visited in turn; a token with r of its k picks still to place
    among the `rem` experts not visited yet takes the current one with probability r/rem, so the tokens
    with r picks left that do is Binomial(n_r, r/rem). Cost draws · E · k binomial draws.
    """
    rng = np.random.default_rng(seed)
    e, k = experts, min(top_k, experts)
    left = np.zeros((draws, k + 1), np.int64)  # left[:, r] = tokens with r picks still to place
    left[:, k] = tokens
    out = np.zeros((draws, e), np.int64)
    for j in range(e):
        rem = e - j
        take = np.zeros((draws, k + 1), np.int64)
        for r in range(1, k + 1):
            take[:, r] = rng.binomial(left[:, r], min(1.0, r / rem))
        out[:, j] = take.sum(axis=1)
        left -= take
        left[:, :-1] += take[:, 1:]
    return out


def _deficiency(counts: np.ndarray, experts: int) -> np.ndarray:
    """G = 2 Σc (log E − H_nats) per row: 0 for perfectly even loads, grows as the entropy falls."""
    c = np.asarray(counts, dtype=np.float64)
    return 2.0 * c.sum(axis=-1) * (math.log(experts) - load_entropy_nats(c))


@lru_cache(maxsize=256)
def entropy_null(tokens: int, top_k: int, experts: int, draws: int = NULL_DRAWS, seed: int = NULL_SEED):
    """Sorted G of `draws` uniform routings (see module doc) and their mean and variance."""
    g = np.sort(_deficiency(uniform_counts(tokens, top_k, experts, draws, seed), experts))
    return g, float(g.mean()), float(g.var())


def gamma_sf(x: float, shape: float, scale: float) -> float:
    """P(X ≥ x) for X ~ Gamma(shape, scale): the regularised upper incomplete gamma Q(shape, x/scale)."""
    if x <= 0:
        return 1.0
    a, z = shape, x / scale
    log_front = a * math.log(z) - z - math.lgamma(a)
    if z < a + 1:  # series for the lower function P, then Q = 1 − P
        term = total = 1.0 / a
        n = a
        for _ in range(10_000):
            n += 1
            term *= z / n
            total += term
            if abs(term) < abs(total) * 1e-15:
                break
        return float(min(1.0, max(0.0, 1.0 - math.exp(log_front) * total)))
    # continued fraction for Q (Lentz)
    tiny = 1e-300
    b = z + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-15:
            break
    return float(min(1.0, math.exp(log_front) * h))


def entropy_pvalue(
    load_entropy: float,
    tokens: int,
    top_k: int,
    experts: int,
    draws: int = NULL_DRAWS,
    seed: int = NULL_SEED,
) -> float:
    """P(normalised load entropy ≤ observed) under uniform routing of `tokens` tokens (Monte-Carlo)."""
    if experts <= 1 or tokens <= 0 or not math.isfinite(load_entropy):
        return 1.0
    slots = tokens * min(top_k, experts)
    g_obs = 2.0 * slots * math.log(experts) * (1.0 - load_entropy) - 1e-9
    g, mean, var = entropy_null(int(tokens), int(top_k), int(experts), draws, seed)
    hits = len(g) - int(np.searchsorted(g, g_obs, side="left"))
    if hits >= _MIN_HITS or var <= 0:
        return (hits + 1) / (len(g) + 1)
    return min((hits + 1) / (len(g) + 1), gamma_sf(g_obs, mean * mean / var, var / mean))


# ---- effective sample size ---------------------------------------------------------------------------------
def effective_tokens(sequence_lengths, correlation: float) -> float:
    """Kish effective sample size of tokens that come in sequences: Σ_s T_s / (1 + (T_s − 1) ρ).

    ρ = intra-sequence correlation of routing: tokens of one text share its topic, language and style, so
    they pick alike experts. ρ = 0 treats every token as independent (T_eff = T); with ρ > 0 one text, however
    long, counts as at most 1/ρ independent tokens and more texts add up.
    """
    lengths = np.asarray(sequence_lengths, dtype=np.float64)
    lengths = lengths[lengths > 0]
    return float((lengths / (1.0 + (lengths - 1.0) * correlation)).sum())


def at_effective_tokens(pvalue, t_eff: float) -> float:
    """pvalue(T) (a function of an integer token count) at a real T_eff ≥ 1: geometric interpolation
    between ⌊T_eff⌋ and ⌈T_eff⌉ (tail probabilities fall about geometrically with T)."""
    low = max(1, math.floor(t_eff))
    w = min(1.0, max(0.0, t_eff - low))
    p_low = pvalue(low)
    if w == 0.0:
        return p_low
    p_high = pvalue(low + 1)
    if p_low <= 0.0 or p_high <= 0.0:
        return p_high if w >= 0.5 else p_low
    return float(math.exp((1 - w) * math.log(p_low) + w * math.log(p_high)))


def total_collapse_pvalue(tokens: int, top_k: int, experts: int) -> float:
    """p-value of the most extreme load (every token sent to the same k experts) under the dead-count null."""
    k = min(top_k, experts)
    return dead_pvalue(experts - k, tokens, k, experts)


@lru_cache(maxsize=256)
def min_tokens_to_judge(top_k: int, experts: int, alpha: float) -> float:
    """Fewest (effective, possibly fractional) tokens at which total collapse (all tokens on the same k
    experts) is significant at `alpha`; below it no load finding can be told apart from chance. 1 for a
    layer whose k reaches E (nothing to judge)."""
    k = min(top_k, experts)
    if experts <= k:
        return 1.0
    n = 1
    while total_collapse_pvalue(n, k, experts) >= alpha:
        n += 1
    if n == 1:
        return 1.0
    p_before, p_at = total_collapse_pvalue(n - 1, k, experts), total_collapse_pvalue(n, k, experts)
    w = (math.log(alpha) - math.log(p_before)) / (math.log(p_at) - math.log(p_before))
    return n - 1 + min(1.0, max(0.0, w)) + 1e-9


# ---- bootstrap confidence bands ----------------------------------------------------------------------------
INDICATORS = ("max_share", "load_entropy", "dead_fraction", "cv")


@dataclass(frozen=True)
class LoadConfidence:
    """Bootstrap bands of one layer's load (tokens resampled with replacement).

    share, share_low, share_high [E]: f_e = c_e/(kT) and its percentile interval at `level`.
    indicators: name → (observed, low, high) for INDICATORS. Percentile intervals of a maximum are biased
    upwards and an expert that received no token stays dead in every resample (its band is [0, 0]); read
    them as the spread a re-run on similar text would show, not as bounds on the model's true load.
    """

    tokens: int
    top_k: int
    level: float
    draws: int
    share: np.ndarray
    share_low: np.ndarray
    share_high: np.ndarray
    indicators: dict[str, tuple[float, float, float]]


def bootstrap_counts(experts: np.ndarray, num_experts: int, draws: int, seed: int) -> np.ndarray:
    """[draws, E] loads of `draws` resamples (with replacement) of the rows of a dispatch [T, k]."""
    rng = np.random.default_rng(seed)
    experts = np.asarray(experts)
    t = len(experts)
    if t == 0:
        return np.zeros((draws, num_experts), np.int64)
    sets, weight = np.unique(experts, axis=0, return_counts=True)  # tokens with the same dispatched set
    picks = rng.multinomial(t, weight / t, size=draws)  # [draws, U] resampled tokens per set
    out = np.zeros(draws * num_experts, np.float64)
    base = (np.arange(draws) * num_experts)[:, None]
    for j in range(sets.shape[1]):
        valid = sets[:, j] >= 0
        idx = base + sets[valid, j][None, :]
        out += np.bincount(idx.ravel(), weights=picks[:, valid].ravel(), minlength=draws * num_experts)
    return out.reshape(draws, num_experts).astype(np.int64)


def load_confidence(
    routing: LayerRouting, level: float = 0.9, draws: int = 2000, seed: int = 0
) -> LoadConfidence:
    """Bootstrap bands (over tokens) of every expert's share and of the layer's balance indicators."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    experts = routing.experts
    t, k, e = len(experts), routing.k, routing.num_experts
    slots = t * k
    observed = expert_counts(routing)
    boot = bootstrap_counts(experts, e, draws, seed)
    q = [(1 - level) / 2, 1 - (1 - level) / 2]
    share = observed / slots if slots else np.full(e, np.nan)
    low, high = np.quantile(boot / slots, q, axis=0) if slots else (share, share)
    routed = getattr(routing, "routed_experts", e)  # zero-computation experts are not balanced
    seen = balance_indicators(observed[:routed], t, k, INDICATORS)
    spread = balance_indicators(boot[:, :routed], t, k, INDICATORS)
    values = np.stack([spread[name] for name in INDICATORS], axis=1)  # [draws, indicators]
    finite = np.isfinite(values).all(axis=0)
    bounds = np.full((2, len(INDICATORS)), np.nan)
    if finite.any():
        bounds[:, finite] = np.quantile(values[:, finite], q, axis=0)
    indicators = {
        name: (float(seen[name][0]), float(bounds[0, i]), float(bounds[1, i]))
        for i, name in enumerate(INDICATORS)
    }
    return LoadConfidence(t, k, level, draws, share, low, high, indicators)


EXPERT_CONFIDENCE_COLUMNS = ["layer", "site", "expert", "share", "share_low", "share_high"]
BALANCE_CONFIDENCE_COLUMNS = ["layer", "site", "indicator", "value", "low", "high", "level"]


def expert_confidence_frame(
    trace: Trace, level: float = 0.9, draws: int = 2000, seed: int = 0
) -> pd.DataFrame:
    """One row per (layer, site, expert): share f_e = c_e/(kT) and its bootstrap band at `level`."""
    parts = []
    for routing in trace.layers:
        band = load_confidence(routing, level, draws, seed)
        parts.append(
            pd.DataFrame(
                {
                    "layer": routing.layer,
                    "site": routing.site,
                    "expert": np.arange(routing.num_experts),
                    "share": band.share,
                    "share_low": band.share_low,
                    "share_high": band.share_high,
                }
            )
        )
    frame = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()
    return frame.reindex(columns=EXPERT_CONFIDENCE_COLUMNS)


def balance_confidence_frame(
    trace: Trace, level: float = 0.9, draws: int = 2000, seed: int = 0
) -> pd.DataFrame:
    """One row per (layer, site, indicator) of INDICATORS: observed value and bootstrap band at `level`."""
    rows = []
    for routing in trace.layers:
        band = load_confidence(routing, level, draws, seed)
        for name, (value, low, high) in band.indicators.items():
            rows.append(
                {
                    "layer": routing.layer,
                    "site": routing.site,
                    "indicator": name,
                    "value": value,
                    "low": low,
                    "high": high,
                    "level": level,
                }
            )
    return pd.DataFrame(rows, columns=BALANCE_CONFIDENCE_COLUMNS)
