"""An independent float64 reimplementation of the attention statistics (`AttentionCapture.summaries`,
`kv_cache_whatif`): per head and sequence the full softmax map in numpy from the captured queries and keys
(soft-cap, learned sink column, GQA key head, mask intervals), then each statistic summed over it.
`deviation(att)` is the fused pass's worst difference from it (mean_distance relative to its size: its
value is a token distance)."""

from __future__ import annotations

import numpy as np

from moeviz.attention import AttentionCapture, summaries

TOLERANCE = 1e-6
WINDOW, GLOBAL = 8, 3


def reference(att: AttentionCapture, layer: int, window: int, global_tokens: int) -> dict[str, np.ndarray]:
    spec = att.layers[layer]
    b_n, h_n, t_n, _ = spec.query.shape
    out = {name: np.zeros((b_n, h_n, t_n)) for name in summaries._STATS}
    for b in range(b_n):
        off, n = int(att.offsets[b]), int(att.lengths[b])
        cols = np.arange(off, off + n)
        i, j = np.arange(n)[:, None], np.arange(n)[None, :]
        allowed = (cols[None, :] >= spec.lo[b, cols][:, None]) & (cols[None, :] <= spec.hi[b, cols][:, None])
        local = (i - j >= 0) & (i - j < window)
        kept = local | (j < global_tokens)
        for h in range(h_n):
            q = spec.query[b, h, cols].astype(np.float64)
            k = spec.key[b, h // (h_n // spec.num_kv_heads), cols].astype(np.float64)
            s = q @ k.T * spec.scaling
            if spec.softcap is not None:
                s = np.tanh(s / spec.softcap) * spec.softcap
            s = np.where(allowed, s, -np.inf)
            if spec.sinks is not None:
                s = np.concatenate([s, np.full((n, 1), float(spec.sinks[h]))], 1)
            e = np.exp(s - s.max(1, keepdims=True))
            probs = e / e.sum(1, keepdims=True)
            p = probs[:, :n]
            with np.errstate(divide="ignore", invalid="ignore"):
                entropy = -np.where(p > 0, p * np.log(p), 0.0).sum(1)
            where = (b, h, slice(off, off + n))
            out["mass"][where] = p.sum(1)
            out["entropy"][where] = entropy
            out["mean_distance"][where] = (p * (i - j)).sum(1) / p.sum(1)
            out["sink_mass"][where] = p[:, 0]
            out["local_mass"][where] = (p * local).sum(1)
            out["kept_mass"][where] = (p * kept).sum(1)
            out["learned_sink_mass"][where] = probs[:, n] if spec.sinks is not None else 0.0
    return out


def deviation(att: AttentionCapture, layers=None) -> float:
    """Max deviation of `token_statistics` from the float64 reference over every statistic, real token and
    head."""
    worst = 0.0
    for layer in layers or att.map_layers:
        got, want = att.token_statistics(layer, WINDOW, GLOBAL), reference(att, layer, WINDOW, GLOBAL)
        for name in summaries._STATS:
            for b, (off, n) in att.sequences():
                diff = np.abs(got[name][b, :, off : off + n] - want[name][b, :, off : off + n])
                if name == "mean_distance":
                    diff = diff / np.maximum(1.0, np.abs(want[name][b, :, off : off + n]))
                worst = max(worst, float(diff.max()))
    return worst
