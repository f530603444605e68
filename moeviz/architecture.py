"""Architecture facts of a loaded model and its trace, shaped as small tables for the app and reports."""

from __future__ import annotations

from typing import Any

import pandas as pd

from moeviz.models.composite import text_config
from moeviz.models.config_keys import EXPERT_COUNT_KEYS, TOP_K_KEYS, config_int, layer_index
from moeviz.trace import Trace


def layer_facts_frame(trace: Trace) -> pd.DataFrame:
    """One row per MoE layer: site, layer, experts (routed), zero_experts (zero-computation experts beside
    them), top_k, score_fn, selection (what the experts were chosen on: "scores", "scores + bias",
    "logits + bias", or "hash table": a token-id table), shared_experts, capacity (None = no capacity
    limit), decision_source (how the routing was read); a looped model adds the block and its pass."""
    looped = any(r.loop_pass for r in trace.layers)
    rows = [
        {
            "site": r.site,
            "layer": r.layer,
            **({"block": layer_index(r.module), "pass": r.loop_pass} if looped else {}),
            "experts": r.routed_experts,
            "zero_experts": r.zero_experts,
            "top_k": r.k,
            "score_fn": r.score_fn,
            "selection": _selection(r),
            "shared_experts": r.shared_experts,
            "capacity": r.capacity,
            "decision_source": r.decision_source,
        }
        for r in trace.layers
    ]
    return pd.DataFrame(rows)


def _selection(routing) -> str:
    if routing.hash_routed:
        return "hash table"
    if routing.bias is None:
        return "scores"
    return "logits + bias" if routing.bias_on == "logits" else "scores + bias"


def dense_layers(trace: Trace) -> list[int]:
    """The decoder layers without a router (dense-first layers, the dense half of an interleaved model):
    every layer index below `num_layers` that no MoE layer of the trace has."""
    routed = {r.layer for r in trace.layers}
    return [i for i in range(trace.model.num_layers) if i not in routed]


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
    config = text_config(getattr(model, "config", None))
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
