"""Which experts handle a domain: the top experts per (domain, layer), against a no-specialisation null."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd

from moeviz.analysis.specialisation import expert_domain_specialisation
from moeviz.trace import Trace

# The exact hypergeometric sums over at most this many values of X per row; beyond, a normal approximation.
EXACT_SUPPORT = 20_000
COUNT_COLUMNS = ["site", "layer", "domain", "expert", "tokens", "dispatched"]
RUN_COLUMNS = ["model", "checkpoint"]  # kept as keys when the frame has them (a store's)
TOP_COLUMNS = [
    "site",
    "layer",
    "domain",
    "rank",
    "expert",
    "tokens",
    "dispatched",
    "slots",
    "share",
    "null_share",
    "lift",
    "null_lo",
    "null_hi",
    "p_value",
    "significant",
]


def domain_top_experts(
    trace_or_frames: Trace | pd.DataFrame,
    seq_domains: Sequence[str] | None = None,
    *,
    top_n: int = 3,
    level: float = 0.95,
) -> pd.DataFrame:
    """The `top_n` experts of each domain at each MoE layer, by their share of the domain's slots.

    Input: a Trace with `seq_domains` (the domain of each sequence), or per-(layer, domain, expert) counts
    with columns site, layer, domain, expert, tokens (the domain's routed tokens at that layer) and
    dispatched (#{t ∈ D : e ∈ S_t}) — `StoreQuery.domain_specialisation()` (the Corpus page's frame; its
    model and checkpoint columns are kept as keys) or `expert_domain_specialisation(...).experts`.

    One row per (site, layer, domain, rank), rank 1 = the domain's busiest expert (ties → lowest id; experts
    the domain never used are left out):
    - dispatched: the domain's tokens sent to the expert; slots: all the domain's dispatched slots (Σ_e);
      share = dispatched / slots.
    - null_share: the expert's share of all slots of the layer, every domain pooled — what the domain would
      give it with no specialisation; lift = share / null_share (1 = no preference).
    - null_lo / null_hi: the central `level` band of share under the null; p_value: one-sided
      P(X ≥ dispatched) under it; significant: p_value < (1 − level) / (D · E), Bonferroni over every
      (domain, expert) pair of the layer, since the top experts are picked as the largest of D · E.

    The null is the permutation of domain labels over the layer's tokens (no specialisation = the label
    says nothing about the routing), computed exactly rather than sampled: with T tokens of which M_e went
    to the expert, a domain of T_D tokens gets X ~ Hypergeometric(T, M_e, T_D) of them. It is exact for
    that permutation, needs no random draws (cheap, reproducible, one sum per shown row; beyond
    EXACT_SUPPORT values of X a normal approximation with the finite-population variance). Tokens are
    treated as exchangeable: neighbouring tokens of a text route alike, so the band is too narrow for
    strongly autocorrelated routing — read `significant` as a screen, the lift as the effect size.
    """
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if top_n < 1:
        raise ValueError(f"top_n must be at least 1, got {top_n}")
    if isinstance(trace_or_frames, Trace):
        if seq_domains is None:
            raise ValueError("a Trace needs seq_domains (the domain of each sequence)")
        counts = expert_domain_specialisation(trace_or_frames, seq_domains, shuffles=0).experts
    else:
        counts = trace_or_frames
    missing = [c for c in COUNT_COLUMNS if c not in counts.columns]
    if missing:
        raise ValueError(f"the frame lacks the columns {missing}")
    keys = [c for c in RUN_COLUMNS if c in counts.columns] + ["site", "layer"]
    columns = keys + TOP_COLUMNS[2:]
    parts = [_layer_top(group, top_n, level) for _, group in counts.groupby(keys, sort=True)]
    parts = [p for p in parts if len(p)]
    if not parts:
        return pd.DataFrame(columns=columns)
    out = pd.concat(parts, ignore_index=True)
    return out[columns].reset_index(drop=True)


def _layer_top(group: pd.DataFrame, top_n: int, level: float) -> pd.DataFrame:
    """The top rows of one (run, site, layer)."""
    frame = group.copy()
    frame["dispatched"] = frame["dispatched"].astype(np.int64)
    frame["tokens"] = frame["tokens"].astype(np.int64)
    sizes = frame.groupby("domain")["tokens"].first()  # T_D
    total_tokens = int(sizes.sum())  # T
    per_expert = frame.groupby("expert")["dispatched"].sum()  # M_e
    frame["slots"] = frame.groupby("domain")["dispatched"].transform("sum")
    all_slots = int(frame["dispatched"].sum())
    frame = frame[frame["slots"] > 0]
    if frame.empty or all_slots == 0:
        return frame.iloc[:0]
    frame["share"] = frame["dispatched"] / frame["slots"]
    frame["null_share"] = frame["expert"].map(per_expert).to_numpy() / all_slots
    with np.errstate(divide="ignore", invalid="ignore"):
        frame["lift"] = frame["share"] / frame["null_share"]
    frame = frame.sort_values(["domain", "dispatched", "expert"], ascending=[True, False, True])
    frame["rank"] = frame.groupby("domain").cumcount() + 1
    top = frame[(frame["rank"] <= top_n) & (frame["dispatched"] > 0)].copy()  # an unused expert tops nothing
    tests = int(frame["domain"].nunique()) * int(frame["expert"].nunique())
    alpha = 1.0 - level
    lo, hi, p = [], [], []
    for row in top.itertuples(index=False):
        m_e = int(per_expert[row.expert])
        a, b, pv = _hypergeom(total_tokens, m_e, int(row.tokens), int(row.dispatched), alpha)
        lo.append(a / row.slots)
        hi.append(b / row.slots)
        p.append(pv)
    top["null_lo"], top["null_hi"], top["p_value"] = lo, hi, p
    top["significant"] = top["p_value"] < alpha / max(tests, 1)
    return top


def _hypergeom(total: int, successes: int, draws: int, observed: int, alpha: float) -> tuple[int, int, float]:
    """X ~ Hypergeometric(total, successes, draws): alpha/2, 1 − alpha/2 quantiles and P(X ≥ observed)."""
    low, high = max(0, draws + successes - total), min(draws, successes)
    if high - low + 1 <= EXACT_SUPPORT:
        xs = np.arange(low, high + 1)
        log_pmf = np.array(
            [_log_comb(successes, int(x)) + _log_comb(total - successes, draws - int(x)) for x in xs]
        ) - _log_comb(total, draws)
        pmf = np.exp(log_pmf - log_pmf.max())
        pmf /= pmf.sum()
        cdf = np.cumsum(pmf)
        q_lo = int(xs[np.searchsorted(cdf, alpha / 2 - 1e-12)])
        q_hi = int(xs[min(int(np.searchsorted(cdf, 1 - alpha / 2 - 1e-12)), len(xs) - 1)])
        tail = float(pmf[xs >= observed].sum())
        return q_lo, q_hi, min(tail, 1.0)
    mean = draws * successes / total
    var = mean * (1 - successes / total) * (total - draws) / max(total - 1, 1)
    sd = math.sqrt(var)
    z = _normal_quantile(1 - alpha / 2)
    tail = (
        0.5 * math.erfc((observed - 0.5 - mean) / (sd * math.sqrt(2))) if sd > 0 else float(observed <= mean)
    )
    return max(low, math.floor(mean - z * sd)), min(high, math.ceil(mean + z * sd)), tail


def _log_comb(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def _normal_quantile(p: float) -> float:
    """Standard normal quantile by bisection on erfc (no SciPy)."""
    lo, hi = -10.0, 10.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if 0.5 * math.erfc(-mid / math.sqrt(2)) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
