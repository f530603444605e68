"""The fused streaming pass (float32 where exactness allows) on synthetic queries and keys against float64
statistics from full maps (the independent reference in tests/support/attention_reference.py). Every
statistic must match within 1e-6. On real captures: tests/models/test_attention_exact_models.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from moeviz.attention import AttentionCapture, AttentionLayer, summaries
from tests.support.attention_reference import GLOBAL, TOLERANCE, WINDOW, deviation


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
    assert deviation(att) <= TOLERANCE


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
