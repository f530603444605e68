"""The fused streaming pass (float32 where exactness allows) against float64 statistics from full maps.

The reference below is an independent reimplementation of the formulas in `AttentionCapture.summaries` and
`kv_cache_whatif`: per head and sequence, the full softmax map in float64 (numpy) from the captured queries
and keys (soft-cap, learned sink column, GQA key head, mask intervals), then each statistic summed over it.
Every statistic must match within 1e-6 (mean_distance relative to its size: its value is a token distance).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import moeviz
from moeviz.attention import AttentionCapture, AttentionLayer, summaries

TOLERANCE = 1e-6
WINDOW, GLOBAL = 8, 3


def _reference(att: AttentionCapture, layer: int, window: int, global_tokens: int) -> dict[str, np.ndarray]:
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


def _deviation(att: AttentionCapture, layers=None) -> float:
    """Max deviation of `token_statistics` from the float64 reference over every statistic, real token and
    head."""
    worst = 0.0
    for layer in layers or att.map_layers:
        got, want = att.token_statistics(layer, WINDOW, GLOBAL), _reference(att, layer, WINDOW, GLOBAL)
        for name in summaries._STATS:
            for b, (off, n) in att.sequences():
                diff = np.abs(got[name][b, :, off : off + n] - want[name][b, :, off : off + n])
                if name == "mean_distance":
                    diff = diff / np.maximum(1.0, np.abs(want[name][b, :, off : off + n]))
                worst = max(worst, float(diff.max()))
    return worst


def _synthetic(softcap, sinks, scale, seed=0) -> AttentionCapture:
    """Padded batch (left padding), GQA 4 query heads on 2 KV heads, a sliding window of 24 keys."""
    gen = np.random.default_rng(seed)
    b_n, h_n, hkv, t_n, dim, window = 2, 4, 2, 70, 16, 24
    lengths, offsets = np.array([70, 45]), np.array([0, 25])
    lo, hi = np.zeros((b_n, t_n), np.int64), np.full((b_n, t_n), -1, np.int64)
    for b in range(b_n):
        for pos in range(lengths[b]):
            col = offsets[b] + pos
            lo[b, col], hi[b, col] = max(offsets[b], col - window + 1), col
    layer = AttentionLayer(
        layer=0,
        module="synthetic",
        query=(gen.standard_normal((b_n, h_n, t_n, dim)) * scale).astype(np.float32),
        key=(gen.standard_normal((b_n, hkv, t_n, dim)) * scale).astype(np.float32),
        lo=lo,
        hi=hi,
        scaling=dim**-0.5,
        value_dim=dim,
        sinks=None if not sinks else gen.standard_normal(h_n).astype(np.float32),
        softcap=softcap,
        sliding_window=window,
    )
    return AttentionCapture(layers={0: layer}, no_map={}, offsets=offsets, lengths=lengths)


@pytest.mark.parametrize("block_elements", [None, 4 * 7 * 20])
@pytest.mark.parametrize(
    ("softcap", "sinks", "scale", "float32_scores"),
    [(None, False, 0.3, True), (None, True, 0.3, True), (None, True, 3.0, False), (20.0, True, 3.0, False)],
)
def test_fused_pass_within_1e6_of_float64(monkeypatch, block_elements, softcap, sinks, scale, float32_scores):
    if block_elements:
        monkeypatch.setattr(summaries, "_BLOCK_ELEMENTS", block_elements)  # many blocks, down to one row each
    att = _synthetic(softcap, sinks, scale)
    # Small scores pass the float32 probe, large ones (as in trained models) need float64 q·kᵀ.
    assert summaries._float32_scores_suffice(att.layers[0]) == float32_scores
    assert _deviation(att) <= TOLERANCE


def test_sample_model_within_1e6_of_float64(sample_model):
    ids = torch.randint(3, 2048, (1, 600), generator=torch.Generator().manual_seed(0))[0].tolist()
    att = moeviz.capture(sample_model, token_ids=[ids, ids[:333]], attention=True).attention
    assert _deviation(att) <= TOLERANCE  # 600 tokens: past the 256-key sliding window


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss", "llama4_text", "deepseek_v3"])
def test_tiny_families_within_1e6_of_float64(tiny_model_dir, family):
    loaded = moeviz.load_model(tiny_model_dir(family))
    gen = torch.Generator().manual_seed(1)
    batch = [torch.randint(3, 120, (n,), generator=gen).tolist() for n in (40, 23)]
    att = moeviz.capture(loaded, token_ids=batch, attention=True).attention
    assert _deviation(att) <= TOLERANCE


def test_streaming_memory_is_bounded(monkeypatch):
    """Scratch buffers stay near _BLOCK_ELEMENTS, whatever the sequence length."""
    seen = []
    original = summaries._buffer

    def spy(pool, name, shape, dtype):
        seen.append(int(np.prod(shape)))
        return original(pool, name, shape, dtype)

    monkeypatch.setattr(summaries, "_buffer", spy)
    monkeypatch.setattr(summaries, "_BLOCK_ELEMENTS", 4 * 16 * 40)
    att = _synthetic(None, True, 0.3)
    att.token_statistics(0, WINDOW, GLOBAL)
    assert max(seen) <= 2 * 4 * 16 * 40
