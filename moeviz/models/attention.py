"""Attention facts per architecture family: which layers are not softmax attention, and KV-cache geometry.

Only this module (with the rest of `models/`) knows model internals; the capture asks it why a layer has
no attention map and what one token costs in the KV cache.
"""

from __future__ import annotations

from typing import Any

# model_type -> what its non-softmax ("linear_attention" / "mamba") layers are.
_LINEAR_LAYER = {
    "jamba": "Mamba layer (selective state-space scan): no attention map",
    "minimax": "lightning attention layer (linear attention with a [d, d] state): no softmax map",
    "qwen3_next": "gated DeltaNet layer (linear attention, delta rule): no softmax map",
    "kimi_linear": "KDA layer (Kimi delta attention, linear): no softmax map",
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
