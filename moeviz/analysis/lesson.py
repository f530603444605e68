"""The numbers of the guided lesson (the app's Learn page) that no other analysis function gives: one token's
way from router logits to combination weights, the chosen experts and weights of a layer's first tokens,
and the share of tokens each routed or shared expert processes, with the shared experts' share of a token's
expert parameters. (Re-routing at another k or without the bias, and the per-expert aux-loss terms, are
`moeviz.analysis.reroute`'s.) A LayerRouting in, numbers or frames out; definitions:
docs/routing-metrics.md.

- `router_walkthrough`: for one token, per expert: logit, score p = score_fn(logit), selection score
  p + b, whether it is among the k chosen, and its weight renormalised over the chosen ones,
  w_e = p_e / Σ_{j∈S} p_j (what Mixtral and DeepSeek-V3 apply; `model_weight` is what the model applied).
- `token_weights_frame`: the first tokens' chosen experts and weights, one row per slot (for a re-routed
  layer's, e.g.).
- `expert_token_share`: per expert, the share of the layer's tokens it processes: c_e / T for a routed
  expert (k/E on average), 1 for each shared expert (every token runs through it); `expert_parameters` and
  `shared_fraction`: the shared experts' share of the expert parameters a token runs through.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from moeviz.analysis.balance import expert_counts
from moeviz.trace import LayerRouting

WALKTHROUGH_COLUMNS = [
    "expert",
    "logit",
    "score",
    "selection_score",
    "chosen",
    "rank",
    "weight",
    "model_weight",
]


def router_walkthrough(routing: LayerRouting, row: int) -> pd.DataFrame:
    """One token (row `row` of the layer) from logits to weights, one row per expert; columns
    WALKTHROUGH_COLUMNS. `chosen` / `rank` (0 = largest weight, -1 = not chosen) are the experts the model
    dispatched (dropped slots refilled by nothing: a dropped expert is not chosen); `weight` =
    p_e / Σ_{chosen} p (0 when not chosen); `model_weight` = the combination weight the model applied."""
    n, e = routing.scores.shape
    if not 0 <= row < n:
        raise IndexError(f"layer {routing.layer} routed {n} tokens; no row {row}")
    experts, weights = routing.experts[row], routing.weights[row]
    scores = np.asarray(routing.scores[row], dtype=np.float64)
    rank = np.full(e, -1, dtype=np.int64)
    model_weight = np.zeros(e, dtype=np.float64)
    order = np.argsort(-np.asarray(weights, dtype=np.float64), kind="stable")
    for r, slot in enumerate(order):
        if experts[slot] >= 0:
            rank[experts[slot]] = r
            model_weight[experts[slot]] = float(weights[slot])
    chosen = rank >= 0
    total = scores[chosen].sum()
    weight = np.where(chosen, scores / total if total > 0 else 0.0, 0.0)
    return pd.DataFrame(
        {
            "expert": np.arange(e),
            "logit": np.asarray(routing.logits[row], dtype=np.float64),
            "score": scores,
            "selection_score": np.asarray(routing.selection_scores[row], dtype=np.float64),
            "chosen": chosen,
            "rank": rank,
            "weight": weight,
            "model_weight": model_weight,
        },
        columns=WALKTHROUGH_COLUMNS,
    )


SHARE_COLUMNS = ["expert", "kind", "tokens", "share"]


def expert_token_share(routing: LayerRouting) -> pd.DataFrame:
    """Per expert of one layer, the share of its T tokens it processes (columns SHARE_COLUMNS): the shared
    experts first (expert "shared" or "shared 1", "shared 2", …: every token, share 1), then each routed
    expert (its id as text: c_e tokens, share c_e / T; the routed shares sum to k minus drops)."""
    t = len(routing.token_rows)
    counts = expert_counts(routing)
    s = routing.shared_experts
    names = ["shared"] if s == 1 else [f"shared {i + 1}" for i in range(s)]
    rows = [{"expert": name, "kind": "shared", "tokens": t, "share": 1.0 if t else np.nan} for name in names]
    rows += [
        {"expert": str(e), "kind": "routed", "tokens": int(c), "share": c / t if t else np.nan}
        for e, c in enumerate(counts)
    ]
    return pd.DataFrame(rows, columns=SHARE_COLUMNS)


def expert_parameters(model, layer: int) -> dict[str, int]:
    """Parameters of block `layer`'s MoE experts in a model (any module with `named_parameters`, e.g.
    `LoadedModel.model`): `routed` (all routed experts, names with `.experts.`), `shared` (names with
    `.shared_expert`), by the block index `.layers.<layer>.` in their names. No torch import."""
    marker = f".layers.{layer}."
    routed = shared = 0
    for name, param in model.named_parameters():
        if marker not in f".{name}":
            continue
        if ".shared_expert" in name:
            shared += param.numel()
        elif ".experts." in name:
            routed += param.numel()
    return {"routed": int(routed), "shared": int(shared)}


def shared_fraction(parameters: dict[str, int], k: int, num_experts: int) -> float:
    """The shared experts' share of the expert parameters one token runs through at a layer:
    shared / (shared + routed · k / E), `parameters` as `expert_parameters` gives them; NaN when none."""
    active = parameters["shared"] + parameters["routed"] * k / num_experts
    return float(parameters["shared"] / active) if active > 0 else float("nan")


WEIGHT_COLUMNS = ["seq", "pos", "token", "rank", "expert", "weight"]


def token_weights_frame(
    tokens: pd.DataFrame, routing: LayerRouting, experts: np.ndarray, weights: np.ndarray, limit: int = 24
) -> pd.DataFrame:
    """The first `limit` tokens of a layer with their chosen experts and weights (e.g. `route_top_k`'s), one
    row per (token, slot), slot rank 0 = largest weight; columns WEIGHT_COLUMNS. `tokens`: the trace's
    `Trace.tokens`; dropped slots (-1) are left out."""
    rows = []
    for i, row in enumerate(routing.token_rows[:limit]):
        token = tokens.iloc[int(row)]
        order = np.argsort(-np.asarray(weights[i], dtype=np.float64), kind="stable")
        for rank, slot in enumerate(order):
            if experts[i, slot] < 0:
                continue
            rows.append(
                {
                    "seq": int(token["seq"]),
                    "pos": int(token["pos"]),
                    "token": str(token["token"]),
                    "rank": rank,
                    "expert": int(experts[i, slot]),
                    "weight": float(weights[i, slot]),
                }
            )
    return pd.DataFrame(rows, columns=WEIGHT_COLUMNS)
