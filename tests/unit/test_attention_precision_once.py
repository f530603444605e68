"""A layer's score precision (the float32 probe) is measured once per layer, not once per window asked for:
the Attention page summarises each shown layer at two windows (the head grid's and the KV-cache what-if's).
The statistics at each window still match the float64 reference from full maps
(tests/support/attention_reference.py), on a layer whose large scores need float64 and one whose small
scores pass in float32."""

from __future__ import annotations

import numpy as np

from moeviz.attention import AttentionCapture, AttentionLayer, summaries
from tests.support.attention_reference import TOLERANCE, reference


def _layer(index: int, scale: float, gen: np.random.Generator) -> AttentionLayer:
    """One causal layer over one sequence of 60 tokens, 4 query heads on 2 KV heads."""
    h_n, hkv, t_n, dim = 4, 2, 60, 16
    return AttentionLayer(
        layer=index,
        module="synthetic",
        query=(gen.standard_normal((1, h_n, t_n, dim)) * scale).astype(np.float32),
        key=(gen.standard_normal((1, hkv, t_n, dim)) * scale).astype(np.float32),
        lo=np.zeros((1, t_n), np.int64),
        hi=np.arange(t_n, dtype=np.int64)[None, :],
        scaling=dim**-0.5,
        value_dim=dim,
    )


def test_precision_probed_once_per_layer(monkeypatch):
    gen = np.random.default_rng(3)
    layers = {0: _layer(0, 0.3, gen), 1: _layer(1, 3.0, gen)}  # float32 passes / float64 needed
    att = AttentionCapture(layers=layers, no_map={}, offsets=np.array([0]), lengths=np.array([60]))
    probed: list[int] = []
    real = summaries._float32_scores_suffice

    def counted(spec):
        probed.append(spec.layer)
        return real(spec)

    monkeypatch.setattr(summaries, "_float32_scores_suffice", counted)
    view = att.subset([0, 1])  # a page's view of some layers shares what the capture measured
    for window, global_tokens in ((32, 0), (8, 4), (5, 0)):
        for layer in (0, 1):
            capture = view if window == 8 else att
            got = capture.token_statistics(layer, window, global_tokens)
            want = reference(att, layer, window, global_tokens)
            for name in summaries._STATS:
                scale = np.maximum(1.0, np.abs(want[name])) if name == "mean_distance" else 1.0
                assert float((np.abs(got[name] - want[name]) / scale).max()) <= TOLERANCE, (layer, name)
    assert sorted(probed) == [0, 1]
    assert [real(layers[0]), real(layers[1])] == [True, False]  # both precisions were exercised
