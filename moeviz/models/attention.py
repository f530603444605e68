"""Attention facts per architecture family: which layers are not softmax attention, and KV-cache geometry.

Only this module (with the rest of `models/`) knows model internals; the capture asks it why a layer has
no attention map and what one token costs in the KV cache.
"""

from __future__ import annotations

from typing import Any

# model_type -> what its non-softmax ("linear_attention" / "mamba") layers are.
_LINEAR_LAYER = {
    "jamba": "Mamba layer (selective state-space scan): no attention map",
    "minimax": "lightning attention layer (linear attention with a [d, d] state): its projections were not "
    "observed, no map",
    "qwen3_next": "gated DeltaNet layer (linear attention, delta rule): its kernel inputs were not observed, "
    "no map",
    "kimi_linear": "KDA layer (Kimi delta attention, per-channel gated delta rule): its kernel inputs were "
    "not observed, no map",
}


def no_map_reason(config: Any, layer: int) -> str:
    """Why decoder layer `layer` produced no softmax attention call."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    kinds = getattr(config, "layers_block_type", None) or getattr(config, "layer_types", None)
    kind = kinds[layer] if kinds and 0 <= layer < len(kinds) else None
    if kind in ("mamba", "linear_attention"):
        return _LINEAR_LAYER.get(config.model_type, f"{kind} layer: no softmax attention map")
    return "the attention function of this layer was not observed (replaced kernel?): no map"


def kv_geometry(config: Any) -> dict[str, Any]:
    """Per-token KV-cache facts the config states (the captured tensors give heads and head dims).

    MLA (DeepSeek-V2/V3, Kimi): inference engines cache the compressed latent `kv_lora_rank` plus the shared
    RoPE key `qk_rope_head_dim` per layer and token; transformers' own cache stores the decompressed
    per-head keys and values. Both are reported.
    """
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    rank = getattr(config, "kv_lora_rank", None)
    rope = getattr(config, "qk_rope_head_dim", None)
    return {
        "model_type": str(config.model_type),
        "mla_latent_dim": int(rank + rope) if isinstance(rank, int) and isinstance(rope, int) else None,
        "sliding_window": getattr(config, "sliding_window", None),
        "attention_chunk_size": getattr(config, "attention_chunk_size", None),
    }


# ---- linear-attention layers whose attention-like map is exact -------------------------------------------
# Each supported layer type is observed through its own projections / kernel inputs during the capture and
# turned into (query, key, value, log_decay, beta) per head, [B, H, T, ...] fp32, such that the layer's
# attention output (before its norm / gate / output projection) is exactly o_t = Σ_j A[t, j] v_j.
#   "decay"       (MiniMax lightning attention):  A[t, j] = (q_t · k_j) · exp(L_t − L_j), j <= t,
#                 L = cumsum(log_decay), log_decay = −s_h (the layer's slope_rate);
#                 q, k, v = act(qkv_proj(x)).
#   "delta"       (Qwen3-Next gated DeltaNet):    S_t = e^{g_t} (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ,
#                 o_t = S_tᵀ q_t with q, k l2-normalised and q scaled by Dk^-½, so
#                 A[t, j] = β_j k_j · r_j, r_t = q_t, r_{j−1} = e^{g_j} (r_j − β_j k_j (k_j · r_j)).
#   "kda"         (Kimi Linear KDA):  the same delta rule with a per-channel gate, log_decay g_t [Dk]:
#                 S_t = (I − β_t k_t k_tᵀ) Diag(e^{g_t}) S_{t−1} + β_t k_t v_tᵀ (gate first, then the delta
#                 correction), o_t = S_tᵀ q_t, so A[t, j] = β_j k_j · r_j with
#                 r_{j−1} = Diag(e^{g_j}) (I − β_j k_j k_jᵀ) r_j = e^{g_j} ⊙ (r_j − β_j k_j (k_j · r_j)).
# Both delta kinds: q, k, v are the kernel's inputs, i.e. after the layer's short causal convolution.
def lightning_modules(model: Any) -> list[tuple[str, int, Any]]:
    """(name, layer, module) of every MiniMax lightning-attention module (decayed linear attention)."""
    found = []
    for name, module in model.named_modules():
        if type(module).__name__.endswith("LightningAttention") and all(
            hasattr(module, a) for a in ("qkv_proj", "slope_rate", "act_fn", "head_dim", "layer_idx")
        ):
            found.append((name, int(module.layer_idx), module))
    return found


def decode_lightning(module: Any, qkv_out: Any) -> dict[str, Any]:
    """q, k, v [B, H, T, D] and log_decay [B, H, T] from the recorded `qkv_proj` output, as the layer
    computes them (activation, per-head split). Padding rows are excluded later by the map (keys of a
    sequence are its real tokens only); the model zeroes them itself."""
    import torch

    with torch.no_grad():
        qkv = module.act_fn(qkv_out)
        b, t, _ = qkv.shape
        h, d = module.num_attention_heads, module.head_dim
        q, k, v = torch.split(qkv.reshape(b, t, h, 3 * d), d, dim=3)
        slopes = module.slope_rate.reshape(-1).to(torch.float64)
        log_decay = (-slopes)[None, :, None].expand(b, h, t)
    return {
        "kind": "decay",
        "query": q.transpose(1, 2),
        "key": k.transpose(1, 2),
        "value": v.transpose(1, 2),
        "log_decay": log_decay,
        "beta": None,
    }


# DeltaNet-style module class -> (python module, global name of the chunked kernel its forward calls, kind).
_DELTA_KERNELS = {
    "Qwen3NextGatedDeltaNet": (
        "transformers.models.qwen3_next.modeling_qwen3_next",
        "torch_chunk_gated_delta_rule",
        "delta",
    ),
    "KimiLinearDeltaAttention": (
        "transformers.models.kimi_linear.modeling_kimi_linear",
        "chunk_kimi_delta_attention",
        "kda",
    ),
}


def delta_rule_modules(model: Any) -> list[tuple[str, int, Any]]:
    """(name, layer, module) of every delta-rule module (Qwen3-Next gated DeltaNet, Kimi Linear KDA)."""
    return [
        (name, int(module.layer_idx), module)
        for name, module in model.named_modules()
        if type(module).__name__ in _DELTA_KERNELS
    ]


def delta_rule_kernel(module: Any) -> tuple[Any, str, str]:
    """(python module, global name, kind) of the chunked delta-rule kernel the module's forward calls."""
    import importlib

    path, name, kind = _DELTA_KERNELS[type(module).__name__]
    return importlib.import_module(path), name, kind


def decode_delta(
    query, key, value, g, beta, initial_state, use_qk_l2norm_in_kernel, kind: str = "delta"
) -> dict[str, Any]:
    """Kernel inputs ([B, T, H, D], beta [B, T, Hv], g [B, T, Hv] for "delta" or [B, T, Hv, Dk] per-channel
    for "kda") -> per-value-head q, k, v [B, Hv, T, D], log_decay [B, Hv, T] or [B, Hv, T, Dk], as the kernel
    prepares them (grouped heads repeated, fp32, l2norm, q scaled by Dk^-½). The map is over these kernel
    inputs, i.e. after the layer's short causal convolution."""
    import torch

    if initial_state is not None:
        raise ValueError("the delta-rule kernel started from a cached state: the map would be partial")
    with torch.no_grad():
        hk, hv = key.shape[2], value.shape[2]
        if hk != hv:
            query = query.repeat_interleave(hv // hk, dim=2)
            key = key.repeat_interleave(hv // hk, dim=2)
        query, key, value, g, beta = (
            x.transpose(1, 2).to(torch.float32) for x in (query, key, value, g, beta)
        )
        if use_qk_l2norm_in_kernel:
            query = query * torch.rsqrt((query * query).sum(-1, keepdim=True) + 1e-6)
            key = key * torch.rsqrt((key * key).sum(-1, keepdim=True) + 1e-6)
        query = query * query.shape[-1] ** -0.5
    return {"kind": kind, "query": query, "key": key, "value": value, "log_decay": g, "beta": beta}
