"""Quantisation what-if (moeviz.whatif.quant) and speculative prefetch (moeviz.whatif.prefetch) on models:
the weights each target quantises, the original model left untouched, and flip rates / recall checked
against independent recomputations on the bundled sample. The fake-quantisers' grids:
tests/unit/test_whatif_quant_grids.py."""

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
from moeviz.whatif.quant import quantisation_flips, target_weights

TEXT = (eval_dir() / "python.txt").read_text(encoding="utf-8")[:600]  # 223 tokens of the sample


# ---- fake-quantisation known answers ---------------------------------------------------------------------


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
