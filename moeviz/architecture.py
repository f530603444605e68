"""Architecture facts of a loaded model and its trace, shaped as small tables for the app and reports."""

from __future__ import annotations

from typing import Any

import pandas as pd

from moeviz.models.config_keys import EXPERT_COUNT_KEYS, TOP_K_KEYS, config_int
from moeviz.trace import Trace


def layer_facts_frame(trace: Trace) -> pd.DataFrame:
    """One row per MoE layer: site, layer, experts, top_k, score_fn, shared_experts, capacity (None =
    no capacity limit), has_bias, decision_source (how the captured routing was decoded)."""
    rows = [
        {
            "site": r.site,
            "layer": r.layer,
            "experts": r.num_experts,
            "top_k": r.k,
            "score_fn": r.score_fn,
            "shared_experts": r.shared_experts,
            "capacity": r.capacity,
            "has_bias": r.bias is not None,
            "decision_source": r.decision_source,
        }
        for r in trace.layers
    ]
    return pd.DataFrame(rows)


def bias_frame(trace: Trace) -> pd.DataFrame:
    """The balancing bias of every biased layer, tidy: site, layer, expert, bias (empty without one)."""
    rows = [
        {"site": r.site, "layer": r.layer, "expert": e, "bias": float(b)}
        for r in trace.layers
        if r.bias is not None
        for e, b in enumerate(r.bias)
    ]
    return pd.DataFrame(rows, columns=["site", "layer", "expert", "bias"])


def parameter_summary(model: Any, experts: int | None = None, top_k: int | None = None) -> dict[str, Any]:
    """Total and active-per-token parameters of an MoE model (any torch module with `.config`).

    Routed-expert parameters are those whose name contains ".experts."; a token uses k of the E routed
    experts of a layer, so active = total − routed × (1 − k/E). Shared experts, attention and embeddings
    count as active. E and k come from the config (Mixtral, DeepSeek, Qwen-MoE, OLMoE key names) or,
    where it lacks them, from `experts` / `top_k` (e.g. a trace's layer). Returns total, active, routed,
    experts, top_k and active_fraction; active is None when E or k is unknown.
    """
    config = getattr(model, "config", None)
    num_experts = config_int(config, EXPERT_COUNT_KEYS) or experts
    k = config_int(config, TOP_K_KEYS) or top_k
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    active = int(total - routed * (1 - k / num_experts)) if num_experts and k else None
    return {
        "total": total,
        "active": active,
        "routed": routed,
        "experts": num_experts,
        "top_k": k,
        "active_fraction": (active / total) if active is not None and total else None,
    }
