"""Where model configs and module trees keep the MoE facts: the one table of config keys and router names.

Every reader of a config (load-time checks, the memory estimate, MoE-site discovery, lineage, architecture
facts) looks a fact up here, in this order, so that a family's spelling added once is known everywhere.
"""

from __future__ import annotations

import re
from typing import Any

# routed experts per MoE layer
EXPERT_COUNT_KEYS = ("num_local_experts", "n_routed_experts", "num_experts", "moe_num_experts")
# experts per token. `top_k` last: a router module's own attribute in most families, and in configs of
# some older models a sampling parameter, so the load-time refusal (`STRICT_TOP_K_KEYS`) leaves it out.
TOP_K_KEYS = (
    "num_experts_per_tok",
    "num_experts_per_token",
    "moe_k",
    "moe_topk",
    "moe_top_k",
    "num_selected_experts",
    "top_k_experts",
    "top_k",
)
STRICT_TOP_K_KEYS = TOP_K_KEYS[:-1]
# decoder (or encoder-decoder) blocks
LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layers", "num_layers", "encoder_layers", "decoder_layers")
SHARED_EXPERT_KEYS = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
# zero-computation (identity) experts the router can choose besides the routed ones
ZERO_EXPERT_KEYS = ("zero_expert_num",)
# the factor the routed experts' combination weights are multiplied by (DeepSeek-V2/V3, GLM-4.5, Kimi: 2.5)
ROUTED_SCALING_KEYS = (
    "routed_scaling_factor",
    "router_scaling_factor",
    "moe_routed_scaling_factor",
    "moe_router_scaling_factor",
)
# a router's attribute name in its MoE block (Switch Transformers and NLLB-MoE call it `classifier`)
ROUTER_NAMES = ("gate", "router", "wg", "classifier")

_INDEX = re.compile(r"(?:^|\.)(\d+)(?=\.|$)")


def config_int(source: Any, keys: tuple[str, ...]) -> int | None:
    """The first positive integer among `keys` on `source` (a config, a module, or a config dict); None if
    none holds one. Booleans do not count."""
    for key in keys:
        value = source.get(key) if isinstance(source, dict) else getattr(source, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def config_float(source: Any, keys: tuple[str, ...]) -> float | None:
    """The first real number among `keys` on `source` (a config, a module, or a config dict); None if none
    holds one (a key set to None counts as absent). Booleans do not count."""
    for key in keys:
        value = source.get(key) if isinstance(source, dict) else getattr(source, key, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def layer_index(path: str) -> int | None:
    """The block index in a module or parameter path: its first all-digit component
    (`model.layers.3.mlp.gate.weight` → 3, `encoder.block.0.layer.1.mlp` → 0); None when it has none."""
    match = _INDEX.search(path)
    return int(match.group(1)) if match else None
