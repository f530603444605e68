"""Attention capture: exact maps against eager `output_attentions`, summaries against full maps, errors."""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest
import torch

import moeviz
from moeviz.attention import SUMMARY_COLUMNS
from moeviz.capture.attention import mask_intervals, patch_active
from moeviz.whatif.kv_cache import kv_cache_whatif

LENGTHS = (20, 13)  # padded batch; longer than gpt_oss's window (8) and llama4's chunk (8)
EXACT_FAMILIES = ["mixtral", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss", "llama4_text"]


def _batch(lengths=LENGTHS, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 120, (n,), generator=gen).tolist() for n in lengths]


def _eager_maps(folder, batch) -> list[np.ndarray]:
    """[B, H, T, T] per layer (None for layers without a map) from the model's own eager attention."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    width = max(map(len, batch))
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, seq in enumerate(batch):
        ids[b, : len(seq)] = torch.tensor(seq)
        mask[b, : len(seq)] = 1
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask, output_attentions=True)
    return [
        None if a is None or a.dim() != 4 or a.shape[-1] != width else a.double().numpy()
        for a in out.attentions
    ]


@pytest.fixture(scope="module")
def captured(tiny_model_dir):
    cache = {}

    def get(family):
        if family not in cache:
            folder = tiny_model_dir(family)
            loaded = moeviz.load_model(folder)
            trace = moeviz.capture(loaded, token_ids=_batch(), attention=True)
            cache[family] = (folder, loaded, trace, _eager_maps(folder, _batch()))
        return cache[family]

    return get


@pytest.mark.parametrize("family", EXACT_FAMILIES)
def test_maps_equal_eager_output_attentions(captured, family):
    _folder, loaded, trace, eager = captured(family)
    att = trace.attention
    assert loaded.model.config._attn_implementation == ("eager" if family == "gpt_oss" else "sdpa")
    compared = 0
    for layer, expected in enumerate(eager):
        if expected is None:
            continue
        for seq, n in enumerate(LENGTHS):
            for head in range(expected.shape[1]):
                got = att.full(layer, head, seq)
                np.testing.assert_allclose(got, expected[seq, head, :n, :n], atol=1e-5, rtol=0)
                compared += 1
                np.testing.assert_allclose(
                    att.row(layer, head, seq, n - 1), expected[seq, head, n - 1, :n], atol=1e-5
                )
                np.testing.assert_allclose(
                    att.block(layer, head, seq, rows=slice(3, 9), cols=[0, 2, 5]),
                    expected[seq, head, 3:9][:, [0, 2, 5]],
                    atol=1e-5,
                )
    assert compared == len(att.map_layers) * len(LENGTHS) * att.layer(att.map_layers[0]).num_heads


def test_gpt_oss_sinks_and_sliding_window(captured):
    _folder, _, trace, eager = captured("gpt_oss")
    att = trace.attention
    assert att.layer(0).sliding_window == 8 and att.layer(1).sliding_window is None
    full0 = att.full(0, 1, 0)
    assert np.allclose(np.tril(full0, -8), 0)  # banded: nothing beyond the window
    sink = att.learned_sink_mass(0, 1, 0)
    np.testing.assert_allclose(sink, 1.0 - eager[0][0, 1, :20, :20].sum(-1), atol=1e-5)
    np.testing.assert_allclose(full0.sum(-1) + sink, 1.0, atol=1e-6)
    assert sink.max() > 1e-3  # the sink really takes mass


def test_llama4_chunked_map_is_block_diagonal(captured):
    _, _, trace, _ = captured("llama4_text")
    full = trace.attention.full(0, 0, 0)
    assert np.allclose(full[8:16, :8], 0) and full[8, 8] > 0


def test_gqa_heads_read_their_kv_head(captured):
    _, _, trace, _ = captured("mixtral")
    spec = trace.attention.layer(0)
    assert (spec.num_heads, spec.num_kv_heads) == (4, 2)
    assert [spec.kv_head(h) for h in range(4)] == [0, 0, 1, 1]


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss", "llama4_text"])
def test_summaries_equal_quantities_from_eager_maps(captured, family):
    _, _, trace, eager = captured(family)
    window = 4
    frame = trace.attention.summaries(window=window)
    assert list(frame.columns) == SUMMARY_COLUMNS
    for layer, expected in enumerate(eager):
        if expected is None:
            continue
        for seq, n in enumerate(LENGTHS):
            p = expected[seq, :, :n, :n]  # [H, n, n]
            i, j = np.arange(n)[:, None], np.arange(n)[None, :]
            with np.errstate(divide="ignore", invalid="ignore"):
                entropy = -np.where(p > 0, p * np.log(p), 0.0).sum(-1)
            mean_distance = (p * (i - j)).sum(-1) / p.sum(-1)
            local = (p * ((i - j >= 0) & (i - j < window))).sum(-1)
            got = frame[(frame.layer == layer) & (frame.seq == seq)].sort_values(["head", "pos"])
            h = p.shape[0]
            np.testing.assert_allclose(got.entropy.to_numpy().reshape(h, n), entropy, atol=2e-5)
            np.testing.assert_allclose(got.mean_distance.to_numpy().reshape(h, n), mean_distance, atol=2e-5)
            np.testing.assert_allclose(got.sink_mass.to_numpy().reshape(h, n), p[..., 0], atol=1e-5)
            np.testing.assert_allclose(got.local_mass.to_numpy().reshape(h, n), local, atol=1e-5)
            np.testing.assert_allclose(
                got.learned_sink_mass.to_numpy().reshape(h, n), 1 - p.sum(-1), atol=1e-5
            )


def test_head_summary_grid(captured):
    _, _, trace, _ = captured("mixtral")
    grid = trace.attention.head_summary(window=4)
    assert len(grid) == 2 * 4 and set(grid["kind"]) <= {"sink", "local", "global"}
    # each mean is the mean of that head's per-token summaries over every real token of every sequence
    stats = ["entropy", "mean_distance", "sink_mass", "local_mass", "learned_sink_mass"]
    expected = trace.attention.summaries(window=4).groupby(["layer", "head"])[stats].mean()
    assert list(zip(grid["layer"], grid["head"], strict=True)) == list(expected.index)
    for name in stats:
        np.testing.assert_allclose(grid[f"mean_{name}"], expected[name], rtol=1e-6, atol=1e-7)


def test_kv_whatif_loses_exactly_the_mass_outside_window_and_globals(captured):
    _, _, trace, eager = captured("mixtral")
    att = trace.attention
    window, g = 4, 2
    whatif = kv_cache_whatif(att, window=window, global_tokens=g)
    lost = []
    for seq, n in enumerate(LENGTHS):
        p = eager[1][seq, :, :n, :n]
        i, j = np.arange(n)[:, None], np.arange(n)[None, :]
        keep = ((i - j >= 0) & (i - j < window)) | (j < g)
        lost.append((p * ~keep).sum(-1))  # [H, n]
    lost = np.concatenate(lost, axis=1)
    got = whatif[whatif.layer == 1].sort_values("head")
    np.testing.assert_allclose(got.mean_lost, lost.mean(1), atol=1e-5)
    np.testing.assert_allclose(got.max_lost, lost.max(1), atol=1e-5)
    # Full-length window keeps everything.
    assert kv_cache_whatif(att, window=max(LENGTHS)).max_lost.max() < 1e-6
    bytes_ = att.kv_cache_bytes_per_token()
    assert (bytes_.bytes_per_token == 2 * 16 * 2 * 4).all()  # K+V · Hkv=2 · head dim 16 · fp32


def test_mla_cache_geometry(captured):
    _, _, trace, _ = captured("deepseek_v3")
    table = trace.attention.kv_cache_bytes_per_token()
    assert (table.mla_latent_bytes == (16 + 8) * 4).all()  # kv_lora_rank + qk_rope_head_dim, fp32
    assert (table.bytes_per_token == 4 * (16 + 16) * 4).all()  # HF cache: 4 heads · (Dk 16 + Dv 16)


@pytest.mark.parametrize(
    "family,reason",
    [("jamba", "Mamba")],  # kimi_linear's KDA layers have a map now: tests/models/test_attention_linear.py
)
def test_hybrid_layers_say_they_have_no_map(tiny_model_dir, family, reason):
    loaded = moeviz.load_model(tiny_model_dir(family))
    trace = moeviz.capture(loaded, token_ids=_batch((10, 7)), attention=True)
    att = trace.attention
    assert att.map_layers and att.no_map
    for layer, why in att.no_map.items():
        assert reason in why
        with pytest.raises(KeyError, match="no attention map"):
            att.row(layer, 0, 0, 0)
    grid = att.head_summary()
    assert set(grid[grid.kind == "no map"].layer) == set(att.no_map)
    assert set(att.map_layers) | set(att.no_map) == set(range(loaded.info.num_layers))


def test_bad_requests_raise_clear_errors(captured):
    _, _, trace, _ = captured("mixtral")
    att = trace.attention
    with pytest.raises(KeyError, match="no layer 7"):
        att.row(7, 0, 0, 0)
    with pytest.raises(IndexError, match="head 4 out of range"):
        att.row(0, 4, 0, 0)
    with pytest.raises(IndexError, match="seq 2 out of range"):
        att.row(0, 0, 2, 0)
    with pytest.raises(IndexError, match="sequence 1 has 13 tokens"):
        att.row(0, 0, 1, 13)
    with pytest.raises(ValueError, match="window"):
        att.summaries(window=0)


def test_capture_without_attention_and_parquet_roundtrip(captured, tmp_path):
    _, loaded, trace, _ = captured("mixtral")
    assert moeviz.capture(loaded, token_ids=_batch()).attention is None
    assert not patch_active()  # the wrapper is gone after every capture
    back = moeviz.Trace.from_parquet(trace.to_parquet(tmp_path / "t.parquet"))
    assert back.attention is None
    assert back.routing_frame().equals(trace.routing_frame())


def test_generate_with_attention_is_refused(captured):
    _, loaded, _, _ = captured("mixtral")
    with pytest.raises(moeviz.MoevizError, match="generate=0"):
        moeviz.capture(loaded, token_ids=_batch(), generate=2, attention=True)


def test_wrapper_removed_on_error(captured):
    _, loaded, _, _ = captured("mixtral")
    with pytest.raises(moeviz.MoevizError):
        moeviz.capture(loaded, token_ids=[[10**6]], attention=True)  # out-of-range id
    original = loaded.model.forward

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    loaded.model.forward = boom
    try:
        with pytest.raises(RuntimeError):
            moeviz.capture(loaded, token_ids=_batch(), attention=True)
    finally:
        loaded.model.forward = original
    assert not patch_active()


def test_concurrent_captures_do_not_mix(captured):
    _, loaded, _, _ = captured("mixtral")
    inputs = {i: _batch((8 + 3 * i,), seed=i) for i in range(4)}
    solo = {i: moeviz.capture(loaded, token_ids=inputs[i], attention=True).attention for i in inputs}
    results, errors = {}, []

    def run(i):
        try:
            for _ in range(3):
                results[i] = moeviz.capture(loaded, token_ids=inputs[i], attention=True).attention
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in inputs]
    plain = threading.Thread(target=lambda: [moeviz.capture(loaded, token_ids=inputs[0]) for _ in range(3)])
    for t in [*threads, plain]:
        t.start()
    for t in [*threads, plain]:
        t.join()
    assert not errors
    for i, att in results.items():
        assert att.lengths.tolist() == [8 + 3 * i]
        np.testing.assert_allclose(att.layer(1).query, solo[i].layer(1).query, atol=1e-6)
    assert not patch_active()


def test_mask_intervals_from_masks():
    t = 6
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    band = causal & ~torch.ones(t, t, dtype=torch.bool).tril(-3)
    lo, hi = mask_intervals(band[None, None], 1, t, t, causal_if_none=False)
    assert lo[0].tolist() == [0, 0, 0, 1, 2, 3] and hi[0].tolist() == list(range(t))
    additive = torch.zeros(1, 1, t, t).masked_fill(~causal, torch.finfo(torch.float32).min)
    lo, hi = mask_intervals(additive, 2, t, t, causal_if_none=False)
    assert lo.shape == (2, t) and hi[1].tolist() == list(range(t))
    lo, hi = mask_intervals(None, 1, t, t, causal_if_none=True)
    assert hi[0].tolist() == list(range(t))
    holes = causal.clone()
    holes[5, 2] = False
    with pytest.raises(ValueError, match="contiguous"):
        mask_intervals(holes[None, None], 1, t, t, causal_if_none=False)


def _reference_intervals(mask: torch.Tensor) -> tuple[list[list[int]], list[list[int]], bool]:
    """Per row of a bool [B, 1, T, S] mask: indices of allowed keys -> min, max, and contiguity."""
    los, his, contiguous = [], [], True
    for b in range(mask.shape[0]):
        lo_row, hi_row = [], []
        for row in mask[b, 0]:
            keys = row.nonzero().flatten().tolist()
            lo_row.append(min(keys) if keys else 0)
            hi_row.append(max(keys) if keys else -1)
            contiguous &= keys == list(range(lo_row[-1], hi_row[-1] + 1))
        los.append(lo_row)
        his.append(hi_row)
    return los, his, contiguous


@pytest.mark.parametrize("rows_per_step", [1024, 3])
def test_mask_intervals_match_reference(monkeypatch, rows_per_step):
    monkeypatch.setattr(sys.modules[mask_intervals.__module__], "_ROW_CHUNK", rows_per_step)
    t, s = 11, 14  # a cache prefix of 3 keys: causal rows are bottom-right aligned
    q = torch.arange(t)[:, None] + (s - t)
    k = torch.arange(s)[None, :]
    causal = k <= q
    window = causal & (k > q - 4)
    padded = torch.stack([causal, causal & (k >= 5)])  # row 1: left padding, its first rows allow nothing
    holes = causal.clone()
    holes[7, 2] = False
    cases = {
        "causal": causal[None, None],
        "sliding": window[None, None],
        "left-padded": padded[:, None],
        "full": torch.ones(1, 1, t, s, dtype=torch.bool),
        "empty": torch.zeros(1, 1, t, s, dtype=torch.bool),
        "non-contiguous": holes[None, None],
        "two-runs": (window | (k == 0))[None, None],
    }
    for name, mask in cases.items():
        ref_lo, ref_hi, contiguous = _reference_intervals(mask)
        additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
        for given in (mask, additive):
            if not contiguous:
                with pytest.raises(ValueError, match="contiguous"):
                    mask_intervals(given, mask.shape[0], t, s, causal_if_none=False)
                continue
            lo, hi = mask_intervals(given, mask.shape[0], t, s, causal_if_none=False)
            assert lo.dtype == hi.dtype == torch.long, name
            assert lo.tolist() == ref_lo and hi.tolist() == ref_hi, name
    lo, hi = mask_intervals(padded[:1, None], 3, t, s, causal_if_none=False)  # one mask row, batch of 3
    assert lo.shape == (3, t) and hi.tolist() == [_reference_intervals(padded[:1, None])[1][0]] * 3
