"""Router margins as the deployment what-ifs and the engine diff read them: how far a token's decision was
from flipping, and quartiles of it (docs/deployment-whatifs.md, "Quantisation"; docs/engine-formats.md,
"Engine diff").

m = min score(S) − max score(eligible ∉ S) on the selection scores (an absolute gap, unlike the relative
margin of `moeviz.analysis.confidence`): a decision whose margin is below the precision of the scores can
flip when the same router runs in another dtype or engine. Plain numpy, no torch: the quantisation what-if
(`moeviz.whatif.quant`, which re-exports both functions) and `moeviz.analysis.engine_diff` share them.
"""

from __future__ import annotations

import numpy as np

from moeviz.analysis.confidence import eligible_experts
from moeviz.analysis.structure import dispatch_mask
from moeviz.trace import LayerRouting


def router_margin(routing: LayerRouting) -> np.ndarray:
    """[N] m = min score(S) − max score(eligible ∉ S) on the selection scores; eligible = every expert, or the
    chosen groups' experts for group-limited routers. +inf when no eligible expert lies outside S; NaN for
    a layer without logits (`has_logits` False: nothing to measure the margin on)."""
    if not routing.has_logits:
        return np.full(len(routing.token_rows), np.nan)
    values = np.asarray(routing.selection_scores, dtype=np.float64)
    chosen = dispatch_mask(routing.experts, routing.num_experts)
    eligible = eligible_experts(routing, routing.experts)
    outside = ~chosen if eligible is None else eligible & ~chosen
    inside = np.where(chosen, values, np.inf).min(axis=1)
    best_out = np.where(outside, values, -np.inf).max(axis=1)
    return inside - best_out


def margin_quartiles(margin: np.ndarray) -> np.ndarray:
    """[N] quartile 1..4 by rank of the margin (1 = lowest; equal-size quartiles, ties by token order)."""
    n = len(margin)
    ranks = np.empty(n, dtype=np.int64)
    ranks[np.argsort(margin, kind="stable")] = np.arange(n)
    return (ranks * 4 // max(n, 1)) + 1
