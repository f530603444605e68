"""Quantisation what-if (moeviz.whatif.quant) and speculative prefetch (moeviz.whatif.prefetch): known
answers for the fake-quantisers, the original model left untouched, and flip rates / recall checked
against independent recomputations on the bundled sample."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch

from moeviz.capture import capture
from moeviz.models.sites import find_moe_sites
from moeviz.samples import eval_dir
from moeviz.whatif.prefetch import prefetch_recall
from moeviz.whatif.quant import fake_quantise, quantisation_flips, target_weights

TEXT = (eval_dir() / "python.txt").read_text(encoding="utf-8")[:600]  # 223 tokens of the sample


# ---- fake-quantisation known answers ---------------------------------------------------------------------
def test_int8_rows_on_an_exact_grid():
    # row 0: absmax 127 → s = 1; row 1: absmax 63.5 → s = 0.5; row 2: zero stays zero
    w = torch.tensor(
        [
            [127.0, 2.5, -3.5, 0.5, -126.6],
            [63.5, 1.25, -1.75, 0.25, 0.74],
            [0.0, 0.0, 0.0, 0.0, 0.0],
        ]
    )
    expected = torch.tensor(
        [
            [127.0, 2.0, -4.0, 0.0, -127.0],  # half to even: 2.5 → 2, -3.5 → -4, 0.5 → 0
            [63.5, 1.0, -2.0, 0.0, 0.5],  # 0.74 / 0.5 = 1.48 → 1
            [0.0, 0.0, 0.0, 0.0, 0.0],
        ]
    )
    assert torch.equal(fake_quantise(w, "int8"), expected)


def test_fp8_on_the_e4m3_grid():
    # absmax 448 → s = 1. e4m3 steps: 32 in [256, 512), 2 in [16, 32), 1/32 in [0.25, 0.5), 0.5 in [4, 8)
    w = torch.tensor([[448.0, 300.0, 17.0, 0.3, -5.5], [0.0] * 5])
    expected = torch.tensor([[448.0, 288.0, 16.0, 0.3125, -5.5], [0.0] * 5])  # 17: tie → even mantissa 16
    assert torch.equal(fake_quantise(w, "fp8"), expected)
    # the same row at a quarter of the scale: s = 0.25 is exact, so the grid scales with it
    assert torch.equal(fake_quantise(w / 4, "fp8"), expected / 4)


def test_int4_groups_of_128_and_a_short_last_group():
    row = torch.zeros(130)
    row[:4] = torch.tensor([7.0, 2.5, 3.5, -7.0])  # group 0: absmax 7 → s = 1
    row[128:] = torch.tensor([1.75, -0.875])  # group 1 (2 inputs, as if zero-padded): s = 0.25
    out = fake_quantise(row[None, :], "int4")[0]
    assert out.shape == (130,)
    assert out[:4].tolist() == [7.0, 2.0, 4.0, -7.0]
    assert out[128:].tolist() == [1.75, -1.0]  # -3.5 → -4 (half to even) × 0.25
    assert not out[4:128].any()


def test_fused_experts_reduce_the_input_dim():
    torch.manual_seed(0)
    fused = torch.randn(3, 5, 256)  # [E, out, in]
    for dtype in ("int8", "fp8", "int4"):
        out = fake_quantise(fused, dtype)
        for e in range(3):
            assert torch.equal(out[e], fake_quantise(fused[e], dtype))
        transposed = fake_quantise(fused.transpose(1, 2).contiguous(), dtype, input_dim=-2)
        assert torch.equal(transposed, out.transpose(1, 2))


# ---- which weights ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3", "olmoe", "gpt_oss"])
def test_targets_on_tiny_families(family):
    from moeviz.testing.tiny_models import build_tiny_model

    model = build_tiny_model(family)
    sites = find_moe_sites(model)
    routers = target_weights(model, sites, "router")
    experts = target_weights(model, sites, "experts")
    assert [tuple(t.param.shape) for t in routers] == [
        (s.num_experts, model.config.hidden_size) for s in sites
    ]
    assert experts and {t.role for t in experts} == {"experts"}
    assert not {id(t.param) for t in routers} & {id(t.param) for t in experts}
    both = {id(t.param) for t in target_weights(model, sites, "both")}
    assert both == {id(t.param) for t in routers + experts}
    if family in ("qwen2_moe", "deepseek_v3"):  # shared experts are quantised with the routed ones
        assert any("shared_expert" in t.name for t in experts)
    if family == "gpt_oss":  # [E, in, out] expert tensors reduce dim -2
        assert {t.input_dim for t in experts if t.param.dim() == 3} == {-2}


def test_group_limited_model_end_to_end(tiny_model_dir):
    import moeviz

    loaded = moeviz.load_model(tiny_model_dir("deepseek_v3"))
    before = {k: v.clone() for k, v in loaded.model.state_dict().items()}
    result = quantisation_flips(loaded, token_ids=list(range(3, 60)), dtype="int4", target="both")
    assert len(result.layers_frame()) == len(loaded.sites)
    assert result.layers_frame()["flip_rate"].between(0, 1).all()
    # margins over the eligible experts (the chosen groups) are never negative
    assert (result.margin_frame()["margin_low"] >= 0).all()
    assert all(torch.equal(before[k], v) for k, v in loaded.model.state_dict().items())


# ---- the sample -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def int4_router(sample_model):
    state = {k: (v.clone(), v.data_ptr()) for k, v in sample_model.model.state_dict().items()}
    result = quantisation_flips(sample_model, text=TEXT, dtype="int4", target="router")
    return result, state


def test_original_model_is_untouched(sample_model, int4_router):
    result, state = int4_router
    after = sample_model.model.state_dict()
    assert after.keys() == state.keys()
    for key, (value, ptr) in state.items():
        assert torch.equal(after[key], value), key
        assert after[key].data_ptr() == ptr, key
    assert result.quantised_params == sum(s.router.weight.numel() for s in sample_model.sites)
    assert result.layers_frame()["flip_rate"].gt(0).any()  # the copy did route differently


def _hand_int4(weight: torch.Tensor) -> torch.Tensor:
    """The sample's hidden size is 128: one INT4 group per router row."""
    assert weight.shape[-1] == 128
    scale = weight.abs().amax(dim=-1, keepdim=True) / 7
    return torch.clamp(torch.round(weight / scale), -7, 7) * scale


def test_flip_rate_matches_an_independent_recomputation(sample_model, int4_router):
    result, _ = int4_router
    twin = copy.deepcopy(sample_model.model)
    with torch.no_grad():
        for site in find_moe_sites(twin):
            site.router.weight.copy_(_hand_int4(site.router.weight))
    hand = dataclasses.replace(sample_model, model=twin, sites=find_moe_sites(twin))
    ids = list(sample_model.tokenizer(TEXT)["input_ids"])
    before, after = capture(sample_model, token_ids=[ids]), capture(hand, token_ids=[ids])
    layers = result.layers_frame().set_index("layer")
    for b in before.layers:
        a = after.layer(b.layer)
        flips = [
            1 - len(set(x) & set(y)) / b.k
            for x, y in zip(b.experts.tolist(), a.experts.tolist(), strict=True)
        ]
        pairs = zip(
            b.experts.tolist(), b.weights.tolist(), a.experts.tolist(), a.weights.tolist(), strict=True
        )
        top1 = [x[int(np.argmax(wx))] == y[int(np.argmax(wy))] for x, wx, y, wy in pairs]
        assert layers.loc[b.layer, "flip_rate"] == pytest.approx(np.mean(flips), abs=1e-12)
        assert layers.loc[b.layer, "top1_agreement"] == pytest.approx(np.mean(top1), abs=1e-12)
        assert (result.flips_frame()["layer"] == b.layer).sum() == sum(f > 0 for f in flips)


def test_router_target_flips_more_than_experts_at_layer_0(sample_model, int4_router):
    router, _ = int4_router
    experts = quantisation_flips(sample_model, text=TEXT, dtype="int4", target="experts")
    # layer 0's router runs before any expert: quantising experts cannot move its routing at all
    assert experts.layers_frame().set_index("layer").loc[0, "flip_rate"] == 0.0
    assert router.layers_frame().set_index("layer").loc[0, "flip_rate"] > 0.0


def test_flips_concentrate_in_the_lowest_margin_quartile(int4_router):
    result, _ = int4_router
    margins = result.margin_frame()
    assert set(margins["quartile"]) == {1, 2, 3, 4}
    by_q = margins.pivot(index="layer", columns="quartile", values="flip_rate")
    assert (by_q[1] >= by_q[4]).all()
    assert by_q[1].mean() > by_q[4].mean()
    # quartiles are ordered by the original margin, and a softmax top-k margin is never negative
    assert (margins.groupby("layer")["margin_low"].apply(lambda s: s.is_monotonic_increasing)).all()
    assert (result.flips_frame()["margin"] >= 0).all()


def test_bytes_per_format_by_hand(int4_router, sample_model):
    result, _ = int4_router
    total = sum(p.numel() for p in sample_model.model.parameters())
    router = 4 * 8 * 128  # 4 layers × [8, 128]
    rows = 4 * 8
    expected = {
        "bf16": 2 * total,
        "int8": 2 * (total - router) + router + 4 * rows,
        "fp8": 2 * (total - router) + router + 4 * rows,
        "int4": 2 * (total - router) + router // 2 + 2 * rows,  # one 128-group per row
    }
    assert dict(zip(result.bytes_frame()["format"], result.bytes_frame()["bytes"], strict=True)) == expected
    data = result.to_json()
    assert set(data) == {"model", "tokens", "definition", "delta_logprob", "layers"}
    assert set(data["layers"][0]) == {"layer", "dtype", "target", "flip_rate", "top1_agreement"}
    assert np.isfinite(data["delta_logprob"])


# ---- speculative prefetch ---------------------------------------------------------------------------------
def test_prefetch_recall_matches_hooks_on_the_gates(sample_model):
    traces = []
    frame = prefetch_recall(sample_model, text=TEXT, trace_out=traces)
    assert list(frame["layer"]) == [1, 2, 3] and list(frame["from_layer"]) == [0, 1, 2]
    # independent: capture each MoE block's input with hooks written here, apply the next gate by hand
    model, seen = sample_model.model, {}
    blocks = [model.model.layers[i].mlp for i in range(4)]
    handles = [b.register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(i, a[0][0])) for i, b in
               enumerate(blocks)]  # fmt: skip
    try:
        ids = list(sample_model.tokenizer(TEXT)["input_ids"])
        with torch.inference_mode():
            model(input_ids=torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    trace = traces[0]
    for row in frame.itertuples():
        with torch.inference_mode():
            logits = torch.nn.functional.linear(seen[row.from_layer], blocks[row.layer].gate.weight)
            predicted = torch.topk(torch.softmax(logits, -1), 2, dim=-1).indices.tolist()
        actual = trace.layer(row.layer).experts.tolist()
        recall = np.mean([len(set(p) & set(a)) / 2 for p, a in zip(predicted, actual, strict=True)])
        assert row.recall == pytest.approx(recall, abs=1e-12)
        assert 0 < row.recall < 1


def test_prefetch_own_router_recalls_everything(sample_model):
    frame = prefetch_recall(sample_model, text=TEXT, offset=0)
    assert list(frame["layer"]) == list(frame["from_layer"]) == [0, 1, 2, 3]
    assert (frame["recall"] == 1.0).all()
