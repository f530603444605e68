"""Independent reference implementation of every supported family's MoE routing rule (a test oracle).

`reference_routing(model, family, **forward_kwargs)` runs one forward of `model`, grabs each router's *input*
hidden states with temporary forward pre-hooks, and recomputes the routing decision from the family's config
and the router's own weights: logits = hidden @ W.T (+ bias), in float32, then the family's rule written out
here by hand. It never calls a router/gate forward or a transformers routing helper, so it can be used to
check what a capture layer reports against what the model must have done.

Rules follow transformers 5.24 (read from `transformers/models/<family>/modeling_*.py`). Only eval mode is
supported: in training several routers add random jitter / Gumbel noise that cannot be reproduced.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

__all__ = ["RULE_FAMILIES", "RefRouting", "canonical_order", "reference_routing", "router_modules"]

# the families whose routing rule is written out here (the others are checked against their experts
# modules' own arguments: tests/models/test_every_family.py)
RULE_FAMILIES = (
    "mixtral", "minimax", "qwen2_moe", "qwen3_moe", "qwen3_next", "olmoe", "hunyuan_v1_moe", "jamba",
    "deepseek_v2", "deepseek_v3", "glm4_moe", "kimi_linear", "ernie4_5_moe", "gpt_oss", "granitemoe",
    "phimoe", "dbrx", "llama4_text", "jetmoe", "switch_transformers", "nllb-moe",
    # the new features: sqrtsoftplus and hash layers, zero-computation experts, loops, raw-logit selection
    "deepseek_v4", "longcat_flash", "inkling2_text", "inkling2_loop_text", "kolibri1",
)  # fmt: skip


@dataclass
class RefRouting:
    """One MoE call's routing, tokens in the order the router saw them (batch·seq flattened, row-major).

    logits:  [N, E] float32 raw router logits (bias included where the router has one).
    experts: [N, k] int64 experts the model dispatched each token to; -1 for a slot dropped by capacity.
    weights: [N, k] float32 combination weight applied to that expert's output (llama4: to its input);
             0 for dropped slots.
    Slots are ordered by descending weight, ties by lower expert id, dropped slots last.
    """

    logits: np.ndarray
    experts: np.ndarray
    weights: np.ndarray


# ----------------------------------------------------------------------------------------------------
# Locating routers
# ----------------------------------------------------------------------------------------------------


def _moe_router(block: nn.Module) -> nn.Module | None:
    """The router of a decoder-only MoE block: the `gate`/`router` sibling of an `experts` child."""
    if not hasattr(block, "experts"):
        return None  # dense layer (first_k_dense_replace, jamba's even layers, ...)
    for name in ("gate", "router"):
        router = getattr(block, name, None)
        if isinstance(router, nn.Module):
            return router
    return None


def router_modules(model: nn.Module, family: str) -> dict[tuple[str, int], nn.Module]:
    """Map (site, layer) -> router module, walking each family's known module tree."""
    out: dict[tuple[str, int], nn.Module] = {}
    if family == "switch_transformers":
        for site, stack in (("encoder", model.encoder), ("decoder", model.decoder)):
            for i, block in enumerate(stack.block):
                mlp = getattr(block.layer[-1], "mlp", None)  # the FF sub-layer is always last
                if mlp is not None and hasattr(mlp, "router"):
                    out[(site, i)] = mlp.router
        return out
    if family == "nllb-moe":
        for site, stack in (("encoder", model.model.encoder), ("decoder", model.model.decoder)):
            for i, layer in enumerate(stack.layers):
                if getattr(layer, "is_sparse", False):
                    out[(site, i)] = layer.ffn.router
        return out
    if family == "dbrx":
        for i, block in enumerate(model.transformer.blocks):
            out[("mlp", i)] = block.ffn.router
        return out
    if family == "jetmoe":
        for i, layer in enumerate(model.model.layers):
            out[("attention", i)] = layer.self_attention.experts.router
            out[("mlp", i)] = layer.mlp.router
        return out
    for i, layer in enumerate(model.model.layers):
        for attr in ("mlp", "feed_forward", "block_sparse_moe"):
            block = getattr(layer, attr, None)
            router = _moe_router(block) if block is not None else None
            if router is not None:
                out[("mlp", i)] = router
                break
    return out


def _router_linear(router: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The router's projection: weight [E, H] and optional bias [E]."""
    weight = getattr(router, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        bias = getattr(router, "bias", None)
        return weight, bias if isinstance(bias, torch.Tensor) else None
    for child in ("wg", "layer", "classifier"):  # hunyuan / dbrx, jetmoe / switch, nllb
        lin = getattr(router, child, None)
        if isinstance(lin, nn.Linear):
            return lin.weight, lin.bias
    raise TypeError(f"cannot find the projection of router {type(router).__name__}")


# ----------------------------------------------------------------------------------------------------
# Small helpers
# ----------------------------------------------------------------------------------------------------


def _top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[N, E] -> [N, k] indices of the k largest scores; ties go to the lower expert id (stable sort)."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]


def _softmax(x: torch.Tensor) -> torch.Tensor:
    """Row softmax in float32 ([N, E] -> [N, E])."""
    return torch.softmax(x.float(), dim=-1)


def _first_argmax(x: torch.Tensor) -> torch.Tensor:
    """[N, E] -> [N] index of the row max (the first one on ties, like torch.argmax)."""
    return _top_k(x, 1)[:, 0]


def canonical_order(experts: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Reorder the k slots of each row: descending weight, ties by lower expert id, dropped (-1) last.

    experts, weights: [N, k]. Returns new arrays of the same shapes.
    """
    experts = np.asarray(experts, dtype=np.int64)
    weights = np.asarray(weights, dtype=np.float32)
    dropped = experts < 0
    # lexsort: last key is primary
    order = np.lexsort((experts, -weights, dropped), axis=-1)
    return np.take_along_axis(experts, order, -1), np.take_along_axis(weights, order, -1)


def _group_mask(group_scores: torch.Tensor, topk_group: int, group_size: int) -> torch.Tensor:
    """[N, G] group scores -> [N, G*group_size] bool mask of experts in the best `topk_group` groups."""
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(1, _top_k(group_scores, topk_group), True)
    return keep.repeat_interleave(group_size, dim=1)


# ----------------------------------------------------------------------------------------------------
# Family rules. Each takes logits [N, E] float32 (plus context) and returns (experts [N, k], weights [N, k]).
# ----------------------------------------------------------------------------------------------------


@dataclass
class _Call:
    """What one router call saw: its flattened input and whatever else the rule needs."""

    hidden: torch.Tensor  # [N, H]
    batch_shape: tuple[int, ...]  # leading dims of the router input, e.g. (B, S) or (N,)
    router: nn.Module
    layer: int
    padding_mask: torch.Tensor | None = None  # nllb only
    expert_capacity: int | None = None  # nllb only: the router's capacity attribute before the call
    token_ids: torch.Tensor | None = None  # [N] the ids of the tokens routed (hash routers look them up)


def _softmax_topk(logits: torch.Tensor, k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """mixtral/minimax/hunyuan (renormalise), qwen*/olmoe (norm_topk_prob), jamba (never)."""
    probs = _softmax(logits)
    idx = _top_k(probs, k)
    w = probs.gather(1, idx)
    if renormalise:
        w = w / w.sum(dim=-1, keepdim=True)
    return idx, w


def _topk_then_softmax(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt_oss / granitemoe / jetmoe: choose on raw logits, softmax over the chosen k only."""
    idx = _top_k(logits, k)
    return idx, _softmax(logits.gather(1, idx))


def _deepseek_v2(logits: torch.Tensor, config: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax; greedy or group-limited (group score = max prob in group) top-k; × routed_scaling_factor.

    No renormalisation, whatever config.norm_topk_prob says (the v2 router ignores it).
    """
    probs = _softmax(logits)
    k, n_exp = config.num_experts_per_tok, probs.shape[1]
    if config.topk_method == "greedy":
        choice = probs
    elif config.topk_method == "group_limited_greedy":
        gsize = n_exp // config.n_group
        group_scores = probs.view(-1, config.n_group, gsize).amax(dim=-1)
        # masked experts get 0.0 (not -inf); softmax probs are > 0 so they never win
        choice = probs.masked_fill(~_group_mask(group_scores, config.topk_group, gsize), 0.0)
    else:
        raise NotImplementedError(f"deepseek_v2 topk_method={config.topk_method!r}")
    idx = _top_k(choice, k)
    return idx, probs.gather(1, idx) * config.routed_scaling_factor


def _sigmoid_grouped(
    logits: torch.Tensor, config: Any, bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """deepseek_v3 / glm4_moe / kimi_linear.

    Select on sigmoid + e_score_correction_bias, restricted to the best `topk_group` of `n_group` groups
    (group score = sum of its top-2 biased scores); weight by the *unbiased* sigmoid, renormalised if
    norm_topk_prob (kimi: moe_renormalize), then × routed_scaling_factor.
    """
    scores = torch.sigmoid(logits.float())
    biased = scores + bias.float()
    n_exp, n_group = scores.shape[1], config.n_group  # kimi: n_group aliases num_expert_group
    gsize = n_exp // n_group
    group_scores = biased.view(-1, n_group, gsize).sort(dim=-1, descending=True).values[..., :2].sum(-1)
    biased = biased.masked_fill(~_group_mask(group_scores, config.topk_group, gsize), float("-inf"))
    idx = _top_k(biased, config.num_experts_per_tok)
    w = scores.gather(1, idx)
    if config.norm_topk_prob:  # kimi: aliases moe_renormalize
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return idx, w * config.routed_scaling_factor


def _ernie(logits: torch.Tensor, config: Any, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax; select on softmax + bias; weight by the unbiased prob, always renormalised with the sum
    clamped below at config.moe_norm_min."""
    probs = _softmax(logits)
    idx = _top_k(probs + bias.float().reshape(-1), config.num_experts_per_tok)  # bias stored as [1, E]
    w = probs.gather(1, idx)
    return idx, w / w.sum(dim=-1, keepdim=True).clamp(min=config.moe_norm_min)


def _phimoe(logits: torch.Tensor, config: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """SparseMixer v2 in eval mode: always 2 experts, each weighted by a softmax over a thresholded set.

    1st: e1 = argmax; experts j with (max - l_j) / max(|l_j|, max) > 2·eps are masked; w1 = softmax(kept)[e1].
    2nd: same on the logits with e1 removed (threshold relative to the new max, |l_j| from the full logits).
    Weights do not sum to 1.
    """
    if config.num_experts_per_tok != 2:
        raise NotImplementedError("phimoe sparsemixer is hard-wired to 2 experts")
    eps = config.router_jitter_noise
    x = logits.float()

    def pick(cands: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top = cands.max(dim=-1, keepdim=True).values
        e = _first_argmax(cands)[:, None]
        factor = x.abs().clamp(min=top)  # |l_j| of the *full* logits, floored at the current max
        far = (top - x) / factor > 2 * eps
        w = _softmax(cands.masked_fill(far, float("-inf"))).gather(1, e)
        return e, w

    e1, w1 = pick(x)
    e2, w2 = pick(x.scatter(1, e1, float("-inf")))
    return torch.cat([e1, e2], 1), torch.cat([w1, w2], 1)


def _dbrx(logits: torch.Tensor, config: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax; top-k; divide by the p-norm of the k weights (p = moe_normalize_expert_weights; None: off)."""
    ffn = config.ffn_config
    probs = _softmax(logits)
    idx = _top_k(probs, ffn.moe_top_k)
    w = probs.gather(1, idx)
    p = ffn.moe_normalize_expert_weights
    if p is not None:
        w = w / w.abs().pow(p).sum(dim=-1, keepdim=True).pow(1.0 / p)
    return idx, w


def _llama4(logits: torch.Tensor, config: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """top-k on logits; weight = sigmoid(logit), applied to the expert *input*."""
    idx = _top_k(logits, config.num_experts_per_tok)
    return idx, torch.sigmoid(logits.gather(1, idx).float())


def _switch(logits: torch.Tensor, config: Any, call: _Call) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax top-1 with per-expert capacity counted *per sequence* in token order; weight = max prob.

    The router sees [B, S, H] and takes a cumsum over S, so each sequence has its own capacity budget.
    Tokens past capacity skip the FFN (expert -1, weight 0).
    """
    probs = _softmax(logits)
    top = _first_argmax(probs)
    w = probs.max(dim=-1).values
    seqs = top.view(-1, call.batch_shape[-1]) if len(call.batch_shape) > 1 else top.view(1, -1)
    kept = torch.zeros_like(seqs, dtype=torch.bool)
    for b in range(seqs.shape[0]):
        seen: dict[int, int] = {}
        for s in range(seqs.shape[1]):
            e = int(seqs[b, s])
            seen[e] = seen.get(e, 0) + 1
            kept[b, s] = seen[e] <= config.expert_capacity
    kept = kept.reshape(-1)
    return torch.where(kept, top, -1)[:, None], torch.where(kept, w, 0.0)[:, None]


def _nllb(logits: torch.Tensor, config: Any, call: _Call) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-2 with capacity (fairseq NLLB-MoE), eval mode, second_expert_policy="all".

    - e1 = argmax prob, e2 = argmax logit among the rest.
    - padding: tokens whose `padding_mask` entry is truthy (4-D mask: last query row) route nowhere.
      NB this mirrors the model literally: `~mask.bool()` is the keep set.
    - positions in each expert's queue: token order, or (batch_prioritized_routing) by descending max prob;
      all first choices queue before all second choices.
    - capacity: ceil(moe_eval_capacity_token_fraction · N) in eval if that fraction > 0, else the router's
      `expert_capacity` (2·ceil(N/E) if None). Queue positions >= capacity are dropped.
    - weights: p1, p2 renormalised to sum 1, either before dropping (normalize_router_prob_before_dropping)
      or over what survived. Experts used = non-zero combine weights.
    """
    if config.second_expert_policy != "all":
        raise NotImplementedError("second_expert_policy 'sampling'/'random' is stochastic")
    n_tok, n_exp = logits.shape
    probs = _softmax(logits)
    e1 = _first_argmax(probs)
    e2 = _first_argmax(logits.float().scatter(1, e1[:, None], float("-inf")))
    m1 = torch.zeros(n_tok, n_exp, dtype=torch.long).scatter_(1, e1[:, None], 1)
    m2 = torch.zeros(n_tok, n_exp, dtype=torch.long).scatter_(1, e2[:, None], 1)

    def normalise(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p1, p2 = (probs * a).sum(1), (probs * b).sum(1)
        denom = (p1 + p2).clamp(min=torch.finfo(torch.float32).eps)
        return p1 / denom, p2 / denom

    if config.normalize_router_prob_before_dropping:
        w1, w2 = normalise(m1, m2)

    pm = call.padding_mask
    if pm is not None and not config.router_ignore_padding_tokens:
        if pm.dim() == 4:
            pm = pm[:, :, -1, :].reshape(-1)[-n_tok:]  # last query row of the attention mask
        keep = ~pm.reshape(-1).bool()
        m1, m2 = m1 * keep[:, None].long(), m2 * keep[:, None].long()

    if config.batch_prioritized_routing:
        order = torch.sort(-probs.max(dim=1).values, stable=True).indices  # most confident first
        inv = torch.empty_like(order)
        inv[order] = torch.arange(n_tok)
        loc1 = ((m1[order].cumsum(0) - 1) * m1[order])[inv]
        loc2 = ((m2[order].cumsum(0) - 1) * m2[order])[inv]
    else:
        loc1, loc2 = m1.cumsum(0) - 1, m2.cumsum(0) - 1
    loc2 = loc2 + m1.sum(0, keepdim=True)  # second choices queue behind every first choice

    if config.moe_eval_capacity_token_fraction > 0:
        capacity = math.ceil(config.moe_eval_capacity_token_fraction * n_tok)
    else:
        capacity = call.expert_capacity if call.expert_capacity is not None else 2 * math.ceil(n_tok / n_exp)
    m1, m2 = m1 * (loc1 < capacity), m2 * (loc2 < capacity)

    if not config.normalize_router_prob_before_dropping:
        w1, w2 = normalise(m1, m2)
    w1, w2 = w1 * m1.sum(1), w2 * m2.sum(1)  # zero where dropped
    experts = torch.stack([torch.where(w1 != 0, e1, -1), torch.where(w2 != 0, e2, -1)], 1)
    return experts, torch.stack([w1, w2], 1)


def _deepseek_v4(logits: torch.Tensor, config: Any, call: _Call) -> tuple[torch.Tensor, torch.Tensor]:
    """sqrtsoftplus scores s = sqrt(log(1 + e^l)); learned layers select top-k on s + e_score_correction_bias,
    hash layers (`mlp_layer_types[i] == "hash_moe"`) take the experts from the frozen table
    tid2eid[token id]. Both weight by the chosen s renormalised (+1e-20), × routed_scaling_factor."""
    scores = torch.sqrt(torch.log1p(torch.exp(logits.float())))
    table = getattr(call.router, "tid2eid", None)
    if table is not None:
        idx = table[call.token_ids].long()
    else:
        idx = _top_k(scores + call.router.e_score_correction_bias.float(), config.num_experts_per_tok)
    w = scores.gather(1, idx)
    return idx, w / (w.sum(dim=-1, keepdim=True) + 1e-20) * config.routed_scaling_factor


def _longcat_flash(logits: torch.Tensor, config: Any, call: _Call) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax over the n_routed_experts + zero_expert_num outputs; top-k on softmax + bias; weights the
    chosen probabilities × routed_scaling_factor, not renormalised. Ids >= n_routed_experts are the
    zero-computation (identity) experts: the model adds weight × hidden for them."""
    probs = _softmax(logits)
    idx = _top_k(probs + call.router.e_score_correction_bias.float(), config.moe_topk)
    return idx, probs.gather(1, idx) * config.routed_scaling_factor


def _inkling2(logits: torch.Tensor, config: Any, call: _Call) -> tuple[torch.Tensor, torch.Tensor]:
    """Inkling-2 (and each pass of Inkling-2-Loop's looped blocks): sigmoid; top-k on sigmoid + bias; weights
    the chosen sigmoid renormalised (+1e-20) × route_scale."""
    scores = torch.sigmoid(logits.float())
    idx = _top_k(scores + call.router.e_score_correction_bias.float(), config.num_experts_per_tok)
    w = scores.gather(1, idx)
    return idx, w / (w.sum(dim=-1, keepdim=True) + 1e-20) * config.route_scale


def _kolibri1(logits: torch.Tensor, config: Any, call: _Call) -> tuple[torch.Tensor, torch.Tensor]:
    """Selection on the raw logits + bias (not on sigmoid + bias); weights the chosen sigmoid, renormalised
    only when norm_topk_prob."""
    idx = _top_k(logits.float() + call.router.e_score_correction_bias.float(), config.num_experts_per_tok)
    w = torch.sigmoid(logits.float().gather(1, idx))
    return idx, w / w.sum(dim=-1, keepdim=True) if config.norm_topk_prob else w


def _route(family: str, config: Any, logits: torch.Tensor, call: _Call) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch to the family's rule. logits [N, E] float32 -> (experts [N, k], weights [N, k])."""
    k = getattr(config, "num_experts_per_tok", None)
    if family in ("mixtral", "minimax"):
        return _softmax_topk(logits, k, renormalise=True)
    if family == "hunyuan_v1_moe":
        topk = config.moe_topk if isinstance(config.moe_topk, int) else config.moe_topk[call.layer]
        return _softmax_topk(logits, topk, renormalise=True)
    if family in ("qwen2_moe", "qwen3_moe", "qwen3_next", "olmoe"):
        return _softmax_topk(logits, k, renormalise=bool(config.norm_topk_prob))
    if family == "jamba":
        return _softmax_topk(logits, k, renormalise=False)
    if family == "deepseek_v2":
        return _deepseek_v2(logits, config)
    if family in ("deepseek_v3", "glm4_moe", "kimi_linear"):
        return _sigmoid_grouped(logits, config, call.router.e_score_correction_bias.detach())
    if family == "ernie4_5_moe":
        return _ernie(logits, config, call.router.moe_statics.e_score_correction_bias.detach())
    if family in ("gpt_oss", "granitemoe", "jetmoe"):
        return _topk_then_softmax(logits, k)
    if family == "phimoe":
        return _phimoe(logits, config)
    if family == "dbrx":
        return _dbrx(logits, config)
    if family == "llama4_text":
        return _llama4(logits, config)
    if family == "switch_transformers":
        return _switch(logits, config, call)
    if family == "nllb-moe":
        return _nllb(logits, config, call)
    if family == "deepseek_v4":
        return _deepseek_v4(logits, config, call)
    if family == "longcat_flash":
        return _longcat_flash(logits, config, call)
    if family in ("inkling2_text", "inkling2_loop_text"):
        return _inkling2(logits, config, call)
    if family == "kolibri1":
        return _kolibri1(logits, config, call)
    raise NotImplementedError(f"no reference routing rule for family {family!r}")


# ----------------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------------


def _text_config(model: nn.Module, family: str) -> Any:
    config = model.config
    if family == "llama4_text" and hasattr(config, "get_text_config"):
        return config.get_text_config()
    return config


def reference_routing(
    model: nn.Module, family: str, **forward_kwargs: Any
) -> dict[tuple[str, int], RefRouting]:
    """Run one forward of `model` and recompute every MoE layer's routing independently.

    Returns {(site, layer): RefRouting}. `site` is "mlp" for decoder-only models ("attention" too for jetmoe's
    mixture-of-attention router), "encoder"/"decoder" for switch_transformers and nllb-moe; `layer` is the
    index of the block holding the MoE layer — for a looped model (Inkling-2-Loop), the block's occurrence in
    execution order, one per pass (`_occurrences`). Raises if a router was not called once (once per pass).
    """
    if model.training:
        raise ValueError("reference_routing supports eval mode only (training routing is stochastic)")
    config = _text_config(model, family)
    routers = router_modules(model, family)
    if not routers:
        raise ValueError(f"no routers found for family {family!r}")
    calls: dict[tuple[str, int], list[_Call]] = {key: [] for key in routers}
    ids = forward_kwargs.get("input_ids")
    token_ids = ids.reshape(-1) if isinstance(ids, torch.Tensor) else None

    def make_hook(key: tuple[str, int]) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            hidden = args[0] if args else kwargs["hidden_states"]
            pad = args[1] if len(args) > 1 else kwargs.get("padding_mask")
            calls[key].append(
                _Call(
                    hidden=hidden.detach().reshape(-1, hidden.shape[-1]).clone(),
                    batch_shape=tuple(hidden.shape[:-1]),
                    router=module,
                    layer=key[1],
                    padding_mask=pad.detach().clone() if isinstance(pad, torch.Tensor) else None,
                    expert_capacity=getattr(module, "expert_capacity", None),  # nllb mutates it per call
                    token_ids=token_ids,
                )
            )

        return hook

    handles = []
    try:
        for key, router in routers.items():
            handles.append(router.register_forward_pre_hook(make_hook(key), with_kwargs=True))
        with torch.no_grad():
            model(**forward_kwargs)
    finally:
        for handle in handles:
            handle.remove()

    out: dict[tuple[str, int], RefRouting] = {}
    for key, router in routers.items():
        occurrences = _occurrences(config, key[1])
        if len(calls[key]) != len(occurrences):
            raise RuntimeError(
                f"router {key} was called {len(calls[key])} times; expected {len(occurrences)}, once per pass"
            )
        weight, bias = _router_linear(router)
        for call, layer in zip(calls[key], occurrences, strict=True):
            with torch.no_grad():
                logits = call.hidden.float() @ weight.detach().float().T
                if bias is not None:
                    logits = logits + bias.detach().float()
                experts, weights = _route(family, config, logits, call)
            exp_np, w_np = canonical_order(experts.cpu().numpy(), weights.float().cpu().numpy())
            logits_np = logits.cpu().numpy().astype(np.float32)
            out[(key[0], layer)] = RefRouting(logits=logits_np, experts=exp_np, weights=w_np)
    return out


def _occurrences(config: Any, block: int) -> list[int]:
    """The layer index of each time block `block` runs in one forward. Inkling-2-Loop runs blocks
    loop_layer_index_start … end − 1 loop_num_passes times, all of them per pass (pre-loop blocks, then the
    loop's blocks pass by pass, then the rest), and numbers layers in that order; every other model runs each
    block once, as layer `block`."""
    start = getattr(config, "loop_layer_index_start", None)
    if start is None:
        return [block]
    end, passes = config.loop_layer_index_end, config.loop_num_passes
    order = list(range(start)) + list(range(start, end)) * passes + list(range(end, config.num_hidden_layers))
    return [i for i, b in enumerate(order) if b == block]


def capture_with_router_inputs(
    loaded: Any, token_ids: list[list[int]]
) -> tuple[Any, dict[int, torch.Tensor]]:
    """`moeviz.capture(loaded, token_ids=...)`, plus what each router of `loaded.sites` received (by site
    index), to recompute the routing independently from the router's own input."""
    import moeviz

    inputs: dict[int, torch.Tensor] = {}
    handles = [
        site.router.register_forward_pre_hook(
            lambda m, args, i=i: inputs.__setitem__(i, args[0].detach().clone())
        )
        for i, site in enumerate(loaded.sites)
    ]
    try:
        trace = moeviz.capture(loaded, token_ids=token_ids)
    finally:
        for handle in handles:
            handle.remove()
    return trace, inputs
