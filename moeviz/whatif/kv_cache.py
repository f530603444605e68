"""The KV-cache what-if: the attention mass each head would lose if its cache kept only a window of keys.

A windowed cache keeps the last `window` keys of each query (0 <= i − j < window) plus the first
`global_tokens` positions; what it evicts is the attention mass the head could no longer see. Computed in
linear memory from a capture's queries and keys (`AttentionCapture`'s streaming statistics, no T × T map),
for softmax layers only: linear-attention maps are not probabilities and Mamba layers keep a fixed state.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from moeviz.attention import AttentionCapture


def kv_cache_whatif(attention: AttentionCapture, window: int, global_tokens: int = 0) -> pd.DataFrame:
    """Attention mass each head would lose if it kept only the last `window` keys (0 <= i − j < window)
    plus the first `global_tokens` positions. One row per (layer, head): mean_lost, max_lost and p95_lost
    over real tokens, plus the KV bytes per token of the layer and, at the longest captured length T,
    what that layer's cache holds (`full_cache_bytes`: T tokens, or min(sliding_window, T) for a
    sliding-window layer) and would hold (`whatif_cache_bytes`: at most window + global_tokens of those,
    never more than the full cache). The byte columns repeat on every head row of a layer: sum one row per
    layer for the model's total."""
    if window < 1 or global_tokens < 0:
        raise ValueError("window must be >= 1 and global_tokens >= 0")
    per_layer = attention.kv_cache_bytes_per_token().set_index("layer")["bytes_per_token"]
    longest = int(attention.lengths.max()) if len(attention.lengths) else 0
    rows = []
    geometry: dict = {}  # one geometry for all layers: layers with the same intervals share block masks
    for layer in attention.map_layers:
        full_tokens = attention.kv_cache_tokens(layer, longest)
        kept_tokens = min(full_tokens, window + global_tokens)  # the what-if only takes away
        # the capture's cached per-token statistics [B, H, T]: mass on real keys, and on the kept keys
        stats = attention.token_statistics(layer, window, global_tokens, geometry)
        lost = np.clip(stats["mass"] - stats["kept_mass"], 0.0, None)
        for head in range(attention.layers[layer].num_heads):
            values = np.concatenate([lost[b, head, off : off + n] for b, (off, n) in attention.sequences()])
            rows.append(
                {
                    "layer": layer,
                    "head": head,
                    "mean_lost": float(values.mean()),
                    "p95_lost": float(np.quantile(values, 0.95)),
                    "max_lost": float(values.max()),
                    "bytes_per_token": int(per_layer[layer]),
                    "full_cache_bytes": int(per_layer[layer]) * full_tokens,
                    "whatif_cache_bytes": int(per_layer[layer]) * kept_tokens,
                }
            )
    return pd.DataFrame(rows)
