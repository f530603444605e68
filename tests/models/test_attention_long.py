"""Attention capture at a few thousand tokens: memory grows linearly, streamed summaries stay exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import moeviz
from moeviz.attention import summaries
from moeviz.whatif.kv_cache import kv_cache_whatif


def _ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 120, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def long_model(tiny_model_dir):
    return moeviz.load_model(tiny_model_dir("mixtral", max_position_embeddings=4096))


def test_capture_memory_grows_linearly(long_model):
    # Padded batch, so the model materialises a [B, 1, T, T] mask: none of it may be kept.
    sizes = {}
    for t in (1024, 2048, 4096):
        trace = moeviz.capture(long_model, token_ids=[_ids(t), _ids(t - 100, 1)], attention=True)
        att = trace.attention
        held = sum(a.nbytes for spec in att.layers.values() for a in (spec.query, spec.key, spec.lo, spec.hi))
        assert held == att.nbytes
        sizes[t] = held
    assert 1.9 < sizes[2048] / sizes[1024] < 2.1
    assert 1.9 < sizes[4096] / sizes[2048] < 2.1  # quadratic would be 4x


@pytest.mark.parametrize("sliding_window", [None, 40])
def test_streamed_summaries_match_full_maps_across_blocks(tiny_model_dir, monkeypatch, sliding_window):
    # With a sliding window, blocks are sized by the keys they span (rows × window), not by position.
    folder = tiny_model_dir("mixtral", max_position_embeddings=4096, sliding_window=sliding_window)
    trace = moeviz.capture(moeviz.load_model(folder), token_ids=[_ids(300), _ids(170, 2)], attention=True)
    att = trace.attention
    monkeypatch.setattr(summaries, "_BLOCK_ELEMENTS", 4 * 37 * 20)  # force many small query blocks
    window = 16
    frame = att.summaries(window=window)
    whatif = kv_cache_whatif(att, window=window, global_tokens=3)
    for layer in att.map_layers:
        lost_all = []
        for seq, n in enumerate((300, 170)):
            for head in range(4):
                p = att.full(layer, head, seq)  # independent path: float64 rows, no streaming
                i, j = np.arange(n)[:, None], np.arange(n)[None, :]
                if sliding_window:
                    assert not p[(i - j) >= sliding_window].any()  # banded
                got = frame[
                    (frame.layer == layer) & (frame.seq == seq) & (frame["head"] == head)
                ].sort_values("pos")
                with np.errstate(divide="ignore", invalid="ignore"):
                    entropy = -np.where(p > 0, p * np.log(p), 0.0).sum(-1)
                np.testing.assert_allclose(got.entropy, entropy, atol=5e-5)
                np.testing.assert_allclose(got.mean_distance, (p * (i - j)).sum(-1), atol=5e-4)
                np.testing.assert_allclose(got.sink_mass, p[:, 0], atol=1e-5)
                np.testing.assert_allclose(got.local_mass, (p * ((i - j) < window)).sum(-1), atol=1e-5)
                lost_all.append((head, (p * ~(((i - j) < window) | (j < 3))).sum(-1)))
        got = whatif[whatif.layer == layer].set_index("head")
        for head in range(4):
            lost = np.concatenate([v for h, v in lost_all if h == head])
            assert abs(got.loc[head, "mean_lost"] - lost.mean()) < 1e-5
