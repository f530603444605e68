"""Architecture facts of a loaded model and its trace, shaped as small tables for the app and reports."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from moeviz.models.composite import text_config
from moeviz.models.config_keys import (
    EXPERT_COUNT_KEYS,
    ROUTED_SCALING_KEYS,
    TOP_K_KEYS,
    config_float,
    config_int,
    layer_index,
)
from moeviz.trace import LayerRouting, Trace

# Relative spread under which every token's combination weights count as one sum: a renormalised top-k in
# bf16 strays by a few parts in a thousand; weights that are not renormalised differ by tens of percent.
SAME_SUM_RTOL = 1e-2


def layer_facts_frame(trace: Trace, config: Any = None) -> pd.DataFrame:
    """One row per MoE layer: site, layer, experts (routed), zero_experts (zero-computation experts beside
    them), top_k, score_fn, selection (what the experts were chosen on: "scores", "scores + bias",
    "logits + bias", or "hash table": a token-id table), n_group and topk_group (the group limit: a token
    chooses among the experts of its best `topk_group` of `n_group` groups; None without one),
    routed_scaling (the routed scaling factor, `routed_scaling`: read off the weights, else from `config`,
    the model's config, when given), shared_experts, capacity (None = no capacity limit), decision_source
    (how the routing was read); a looped model adds the block and its pass."""
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
            "n_group": r.n_group,
            "topk_group": r.topk_group,
            "routed_scaling": routed_scaling(r, config),
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


def weight_sum(routing: LayerRouting) -> float | None:
    """The sum every token's combination weights share at this layer, read off the captured weights (3
    significant digits): a router that renormalises its top-k and then multiplies by a routed scaling
    factor gives every token that factor (1 without one). None where the sums differ (weights not
    renormalised), without recorded weights, or where no token kept all its slots (a dropped slot takes
    its weight with it)."""
    if not routing.has_weights or not len(routing.weights):
        return None
    whole = (routing.experts >= 0).all(axis=1)
    if not whole.any():
        return None
    sums = routing.weights[whole].sum(axis=1, dtype=np.float64)
    centre = float(np.median(sums))
    if centre <= 0 or not np.allclose(sums, centre, rtol=SAME_SUM_RTOL, atol=0):
        return None
    return float(f"{centre:.3g}")


def routed_scaling(routing: LayerRouting, config: Any = None) -> float | None:
    """The factor this layer multiplies its routed experts' weights by: read off the captured weights where
    every token's weights share one sum (`weight_sum`: what the model did), else the config's routed
    scaling factor (`ROUTED_SCALING_KEYS`; weights that are not renormalised carry it too, but do not show
    it), else None."""
    measured = weight_sum(routing)
    if measured is not None:
        return measured
    return config_float(text_config(config), ROUTED_SCALING_KEYS) if config is not None else None


def group_limit(facts: pd.DataFrame) -> str:
    """The group limit of `layer_facts_frame` rows in words: "best 4 of 8 groups" where every grouped layer
    has the same one ("… (n of N MoE layers)" when only some layers have it), "none", or "varies by layer"."""
    grouped = facts[facts["n_group"].notna() & facts["topk_group"].notna()] if len(facts) else facts
    if grouped.empty:
        return "none"
    limits = {(int(g), int(k)) for g, k in zip(grouped["n_group"], grouped["topk_group"], strict=True)}
    if len(limits) > 1:
        return "varies by layer"
    ((groups, best),) = limits
    text = f"best {best} of {groups} groups"
    if len(grouped) < len(facts):
        text += f" ({len(grouped)} of {len(facts)} MoE layers)"
    return text


def scaling_summary(facts: pd.DataFrame) -> str:
    """The routed scaling factor of `layer_facts_frame` rows in words: "× 2.5" where every layer that tells
    has the same one ("… (n of N MoE layers)" when some do not tell), "unknown", or "varies by layer"."""
    known = facts["routed_scaling"].dropna() if len(facts) else pd.Series(dtype=float)
    if known.empty:
        return "unknown"
    values = sorted(set(known.astype(float)))
    if len(values) > 1:
        return "varies by layer"
    text = f"× {values[0]:g}"
    if len(known) < len(facts):
        text += f" ({len(known)} of {len(facts)} MoE layers)"
    return text


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
    count as active — the input embedding too, although a token reads one row of it: model cards differ
    (Mixtral's 12.9 B counts it, gpt-oss's 5.1 B does not), so `input_embedding` gives its size (0 where
    the output head shares its weights, which every token uses in full) and `active_without_input_embedding`
    the count without it. E and k come from the config (Mixtral, DeepSeek, Qwen-MoE, OLMoE key names) or,
    where it lacks them, from `experts` / `top_k` (e.g. a trace's layer). Returns total, active, routed,
    experts, top_k, active_fraction, input_embedding and active_without_input_embedding; the active counts
    are None when E or k is unknown.
    """
    config = text_config(getattr(model, "config", None))
    num_experts = config_int(config, EXPERT_COUNT_KEYS) or experts
    k = config_int(config, TOP_K_KEYS) or top_k
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    active = int(total - routed * (1 - k / num_experts)) if num_experts and k else None
    embedding = input_embedding_parameters(model)
    return {
        "total": total,
        "active": active,
        "routed": routed,
        "experts": num_experts,
        "top_k": k,
        "active_fraction": (active / total) if active is not None and total else None,
        "input_embedding": embedding,
        "active_without_input_embedding": None if active is None else active - embedding,
    }


def input_embedding_parameters(model: Any) -> int:
    """Parameters of the model's input embedding (`get_input_embeddings()`) that the output head does not
    share: 0 for tied embeddings, or a model without one."""
    get_input = getattr(model, "get_input_embeddings", None)
    embedding = get_input() if callable(get_input) else None
    if embedding is None:
        return 0
    get_output = getattr(model, "get_output_embeddings", None)
    head = get_output() if callable(get_output) else None
    shared = {id(p) for p in head.parameters()} if head is not None else set()
    return sum(p.numel() for p in embedding.parameters() if id(p) not in shared)
