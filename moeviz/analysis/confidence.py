"""Per-token router confidence and fragility (definitions: docs/routing-metrics.md).

p[t, e] is the router's probability distribution (`losses.router_probs`: softmax scores, or sigmoid scores
normalised to sum 1). S_t is the router's decision: the dispatched experts, where a slot dropped by capacity
(-1) is refilled from the top-k of the selection scores, because capacity, not the router, dropped it.

- entropy H_t = −Σ_e p log p (nats), entropy_norm = H_t / log E ∈ [0, 1]; top1_score = max_e p.
- margin m_t = (min_{e∈S_t} p − max_{e∉S_t} p) / min_{e∈S_t} p, clipped at 0, computed on p as the doc
  defines it (for sigmoid routers the normalisation cancels in the ratio, so it is the same on raw scores).
  For a biased router p did not make the decision, so m_t is often 0 there; margin_selection is the same
  formula on the selection scores p + b (what the decision was made on), NaN where min_{S_t}(p + b) <= 0.
  When k = E nothing lies outside S_t: margin = 1 (max over the empty set taken as 0), margin_selection NaN.
- group-limited routers (DeepSeek-V2/V3, GLM-4.5, Kimi: `LayerRouting.n_group`): an expert outside the
  token's chosen groups was never a candidate, so both margins take the max over the *eligible* experts
  not in S_t, i.e. those of the chosen groups (`eligible_experts`), not over all experts. Over all experts
  the selection margin of such a router is 0 for most tokens (a strong expert of an unchosen group).
- unbiased_overlap = |topk(p) ∩ S_t| / k for routers with a balancing bias (NaN without one): 1 = the bias
  changed nothing for this token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from moeviz.analysis.losses import router_probs, rowwise_max, rowwise_min, rowwise_sum, top_k_indices
from moeviz.trace import LayerRouting, Trace

CONFIDENCE_COLUMNS = [
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
    "dropped",
]


def token_entropy(probs: np.ndarray) -> np.ndarray:
    """H_t = −Σ_e p log p in nats per row [N] of a distribution [N, E] (0 log 0 = 0)."""
    probs = np.asarray(probs, dtype=np.float32)
    tiny = np.finfo(np.float32).tiny
    return -rowwise_sum(probs * np.log(np.maximum(probs, tiny)))


def decision_set(routing: LayerRouting) -> np.ndarray:
    """S_t as ids [N, k]: the dispatched experts, dropped slots (-1) refilled from top-k(selection scores)."""
    experts = routing.experts
    if not (experts < 0).any():  # the common case, checked flat (cheap)
        return experts
    dropped_rows = rowwise_max(experts < 0)
    filled = experts.copy()
    filled[dropped_rows] = top_k_indices(routing.selection_scores[dropped_rows], routing.k)
    return filled


def eligible_experts(routing: LayerRouting, chosen: np.ndarray | None = None) -> np.ndarray | None:
    """[N, E] bool: the experts each token could have been dispatched to under group-limited routing, i.e.
    the experts of its `topk_group` best groups by the router's group score of the selection scores
    ("top2_sum": sum of the group's two best, DeepSeek-V3; "max": DeepSeek-V2), plus the groups of the
    experts in `chosen` [N, k] (-1 ignored), so that the decision itself is always eligible. None when the
    layer does not limit groups (every expert is eligible)."""
    n_group, topk_group = routing.n_group, routing.topk_group
    if (
        not n_group
        or not topk_group
        or n_group <= 1
        or topk_group >= n_group
        or routing.num_experts % n_group
    ):
        return None
    return eligible_by_groups(routing.selection_scores, n_group, topk_group, routing.group_score, chosen)


def eligible_by_groups(
    selection: np.ndarray,
    n_group: int,
    topk_group: int,
    group_score: str | None,
    chosen: np.ndarray | None = None,
) -> np.ndarray:
    """`eligible_experts` from selection scores [N, E] and the group rule (E divisible by n_group)."""
    n, e = selection.shape
    size = e // n_group
    grouped = np.asarray(selection, dtype=np.float32).reshape(n, n_group, size)
    if group_score == "max":
        group_scores = grouped.max(axis=2)
    else:  # "top2_sum", the DeepSeek-V3 rule
        best2 = -np.partition(-grouped, 1, axis=2)[:, :, :2] if size > 1 else grouped
        group_scores = best2.sum(axis=2)
    keep = np.zeros((n, n_group), dtype=bool)
    np.put_along_axis(keep, top_k_indices(group_scores, topk_group, ordered=False), True, axis=1)
    if chosen is not None:
        rows, slots = np.nonzero(chosen >= 0)
        keep[rows, chosen[rows, slots] // size] = True
    return np.repeat(keep, size, axis=1)


def topk_margin(
    values: np.ndarray,
    selected: np.ndarray,
    empty_outside: float | None = 0.0,
    eligible: np.ndarray | None = None,
) -> np.ndarray:
    """m_t = (min_{S_t} v − max_{∉S_t} v) / min_{S_t} v clipped at 0, per row [N] of values [N, E].

    `selected` [N, k] distinct ids per row (-1 ignored). Rows whose min_{S_t} v <= 0 or whose S_t is empty
    give NaN. When S_t covers every expert the max outside is `empty_outside` (None → the margin is NaN).
    `eligible` [N, E] bool (group-limited routing, see `eligible_experts`): only eligible experts outside
    S_t compete; when none is left the max outside is `empty_outside` too.
    """
    values = np.asarray(values, dtype=np.float32)
    selected = np.asarray(selected)
    valid = selected >= 0
    # a dropped slot (-1) repeats a valid id of its row (the row max), so it changes neither min nor mask
    safe = (
        selected if valid.all() else np.maximum(np.where(valid, selected, rowwise_max(selected)[:, None]), 0)
    )
    inside = rowwise_min(np.where(valid, np.take_along_axis(values, safe, axis=1), np.inf))
    masked = values.copy() if eligible is None else np.where(eligible, values, np.float32(-np.inf))
    np.put_along_axis(masked, safe, -np.inf, axis=1)
    outside = rowwise_max(masked)
    full = outside == -np.inf  # nothing left outside S_t
    if full.any():
        outside = np.where(full, np.float32(np.nan if empty_outside is None else empty_outside), outside)
    ok = np.isfinite(inside) & (inside > 0) & ~np.isnan(outside)
    margin = np.full(values.shape[0], np.nan, dtype=np.float32)
    np.divide(inside - outside, inside, out=margin, where=ok)
    return np.where(ok, np.maximum(margin, 0.0), np.nan).astype(np.float32)


def topk_overlap(probs: np.ndarray, selected: np.ndarray, k: int) -> np.ndarray:
    """|topk(p) ∩ S_t| / k per row [N]; `selected` [N, k'] ids (-1 never matches)."""
    top = top_k_indices(np.asarray(probs), k, ordered=False)
    hits = np.zeros(len(top), dtype=np.int64)
    for i in range(top.shape[1]):  # ids are distinct within a row, so pair matches count each hit once
        for j in range(selected.shape[1]):
            hits += top[:, i] == selected[:, j]
    return (hits / k).astype(np.float32)


@dataclass(frozen=True)
class LayerConfidence:
    """Per-token confidence of one layer, every array [N] in the layer's token order."""

    entropy: np.ndarray
    entropy_norm: np.ndarray
    top1_score: np.ndarray
    margin: np.ndarray
    margin_selection: np.ndarray  # NaN without a bias
    unbiased_overlap: np.ndarray  # NaN without a bias
    dropped: np.ndarray  # slots of the token dropped by capacity


def layer_confidence(routing: LayerRouting) -> LayerConfidence:
    """Entropy, top-1 score, boundary margins and (biased routers) overlap for every token of one layer."""
    n, e = routing.logits.shape
    probs = router_probs(routing)
    entropy = token_entropy(probs)
    # clipped: fp32 rounding can put a uniform row a hair above 1
    entropy_norm = np.minimum(entropy / np.float32(np.log(e)), 1) if e > 1 else np.zeros(n, np.float32)
    chosen = decision_set(routing)
    eligible = eligible_experts(routing, chosen)
    nan = np.full(n, np.nan, dtype=np.float32)
    if routing.bias is None:
        margin_selection = overlap = nan
    else:
        margin_selection = topk_margin(
            routing.selection_scores, chosen, empty_outside=None, eligible=eligible
        )
        overlap = topk_overlap(probs, chosen, routing.k)
    return LayerConfidence(
        entropy=entropy,
        entropy_norm=entropy_norm.astype(np.float32),
        top1_score=rowwise_max(probs) if e else nan,
        margin=topk_margin(probs, chosen, eligible=eligible),
        margin_selection=margin_selection,
        unbiased_overlap=overlap,
        dropped=rowwise_sum(routing.experts < 0),
    )


def confidence_frame(trace: Trace) -> pd.DataFrame:
    """Tidy per-token confidence: one row per (token, MoE layer); columns CONFIDENCE_COLUMNS.

    seq, pos, token come from `trace.tokens`; dropped = slots of the token dropped by capacity.
    """
    seq = trace.tokens["seq"].to_numpy()
    pos = trace.tokens["pos"].to_numpy()
    token = trace.tokens["token"].to_numpy()
    parts = []
    for routing in trace.layers:
        c = layer_confidence(routing)
        rows = routing.token_rows
        parts.append(
            pd.DataFrame(
                {
                    "seq": seq[rows],
                    "pos": pos[rows],
                    "token": token[rows],
                    "layer": np.full(len(rows), routing.layer, dtype=np.int64),
                    "site": routing.site,
                    "entropy": c.entropy,
                    "entropy_norm": c.entropy_norm,
                    "top1_score": c.top1_score,
                    "margin": c.margin,
                    "margin_selection": c.margin_selection,
                    "unbiased_overlap": c.unbiased_overlap,
                    "dropped": c.dropped,
                }
            )
        )
    if not parts:
        return pd.DataFrame(columns=CONFIDENCE_COLUMNS)
    return pd.concat(parts, ignore_index=True)


CONFIDENCE_SUMMARY_COLUMNS = [
    "layer",
    "site",
    "tokens",
    "entropy_norm_mean",
    "top1_score_mean",
    "margin_median",
    "fragile_fraction",
    "unbiased_overlap_mean",
]


def confidence_summary_frame(trace: Trace, fragile_margin: float = 0.1) -> pd.DataFrame:
    """One row per MoE layer: mean normalised entropy, mean top-1 score, median margin, the fraction of
    tokens whose margin is below `fragile_margin` (decisions a 10% score perturbation can flip, by default)
    and the mean unbiased overlap (NaN without a bias). NaN statistics for a layer without tokens."""
    rows = []
    for routing in trace.layers:
        c = layer_confidence(routing)
        n = len(c.entropy)
        margins = c.margin[~np.isnan(c.margin)]
        rows.append(
            {
                "layer": routing.layer,
                "site": routing.site,
                "tokens": n,
                "entropy_norm_mean": float(c.entropy_norm.mean()) if n else np.nan,
                "top1_score_mean": float(c.top1_score.mean()) if n else np.nan,
                "margin_median": float(np.median(margins)) if len(margins) else np.nan,
                "fragile_fraction": float((margins < fragile_margin).mean()) if len(margins) else np.nan,
                "unbiased_overlap_mean": (
                    float(c.unbiased_overlap.mean()) if n and routing.bias is not None else np.nan
                ),
            }
        )
    return pd.DataFrame(rows, columns=CONFIDENCE_SUMMARY_COLUMNS)
