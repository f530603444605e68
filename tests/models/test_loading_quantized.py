"""Quantised checkpoints as the big MoE models ship them, built here from tiny random models: FP8 block
quantisation (DeepSeek-V3, Kimi K2, Qwen3-FP8) and gpt-oss's MXFP4 experts. On a CPU transformers dequantises
both on load; capture must then be exact on what the dequantised model computed. Quantisations it cannot run
here are refused before any weight is read."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import moeviz
from moeviz.errors import UnsupportedQuantizationError
from moeviz.testing.quantized import (
    fp8_block_quantize,
    fp8_dequantize,
    mxfp4_dequantize,
    mxfp4_quantize,
    save_fp8_copy,
    save_mxfp4_copy,
)
from tests.support.reference_routing import canonical_order, capture_with_router_inputs, reference_routing

SEQS = [list(range(3, 15)), [40, 41, 42, 43, 44, 45]]
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU dequantisation path")


def _batch(seqs, pad=0):
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for b, seq in enumerate(seqs):
        ids[b, : len(seq)] = torch.tensor(seq)
        mask[b, : len(seq)] = 1
    return {"input_ids": ids, "attention_mask": mask}, width


def test_quantisers_round_trip():
    weight = torch.randn(48, 64)
    q, scale = fp8_block_quantize(weight, (16, 32))
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (3, 2)
    assert (fp8_dequantize(q, scale) - weight).abs().max() < 0.07 * weight.abs().max()
    blocks, scales = mxfp4_quantize(torch.randn(2, 8, 64))
    assert blocks.shape == (2, 8, 2, 16) and blocks.dtype == torch.uint8 and scales.shape == (2, 8, 2)
    exact = torch.tensor([[0.5, -1.0, 1.5, 6.0] * 8])  # representable values come back exactly
    np.testing.assert_array_equal(mxfp4_dequantize(*mxfp4_quantize(exact)).numpy(), exact.numpy())


def test_fp8_block_quantised_deepseek_v3_loads_dequantised_and_captures_exactly(tiny_model_dir, tmp_path):
    folder = save_fp8_copy(tiny_model_dir("deepseek_v3"), tmp_path / "ds3-fp8", block=(8, 8))
    stored = load_file(folder / "model.safetensors")
    assert stored["model.layers.1.mlp.experts.3.up_proj.weight"].dtype == torch.float8_e4m3fn

    loaded = moeviz.load_model(folder)
    assert loaded.info.dtype == "bfloat16"
    assert any(
        "FP8 (e4m3) block-quantised in 8×8 blocks" in n and "dequantised" in n for n in loaded.info.notes
    )
    # the weights the model computes with are the checkpoint's, dequantised block by block
    name = "model.layers.0.self_attn.q_a_proj.weight"
    expected = fp8_dequantize(stored[name], stored[name + "_scale_inv"]).to(torch.bfloat16)
    assert torch.equal(loaded.model.model.layers[0].self_attn.q_a_proj.weight, expected)
    name = "model.layers.1.mlp.experts.3.gate_proj.weight"
    expected = fp8_dequantize(stored[name], stored[name + "_scale_inv"]).to(torch.bfloat16)
    assert torch.equal(loaded.model.model.layers[1].mlp.experts.gate_up_proj[3, :32], expected)

    trace = moeviz.capture(loaded, token_ids=SEQS)
    kwargs, width = _batch(SEQS)
    reference = reference_routing(loaded.model, "deepseek_v3", **kwargs)
    for layer in trace.layers:
        ref = reference[layer.key]
        tokens = trace.tokens.iloc[layer.token_rows]
        flat = tokens.seq.to_numpy() * width + tokens.pos.to_numpy()
        ref_experts, ref_weights = canonical_order(ref.experts[flat], ref.weights[flat])
        np.testing.assert_array_equal(layer.experts, ref_experts)
        np.testing.assert_allclose(layer.weights, ref_weights, atol=1e-6)

    full = moeviz.load_model(folder, dtype="float32")  # dequantised straight to fp32
    name = "model.layers.0.self_attn.q_a_proj.weight"
    assert torch.equal(
        full.model.model.layers[0].self_attn.q_a_proj.weight,
        fp8_dequantize(stored[name], stored[name + "_scale_inv"]),
    )


def test_mxfp4_gpt_oss_loads_dequantised_and_captures_exactly(tiny_model_dir, tmp_path):
    folder = save_mxfp4_copy(tiny_model_dir("gpt_oss"), tmp_path / "gpt-oss-mxfp4")
    stored = load_file(folder / "model.safetensors")
    assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in stored

    loaded = moeviz.load_model(folder)
    assert loaded.info.dtype == "bfloat16"
    assert any("MXFP4" in n and "dequantised" in n for n in loaded.info.notes)
    experts = loaded.model.model.layers[0].mlp.experts
    blocks, scales = (stored[f"model.layers.0.mlp.experts.gate_up_proj_{s}"] for s in ("blocks", "scales"))
    assert torch.equal(experts.gate_up_proj, mxfp4_dequantize(blocks, scales).transpose(-1, -2).bfloat16())

    # gpt-oss routes in the model's dtype: recompute its rule (bf16 projection + bias, top-k on the logits,
    # softmax over the k) from what each router received
    trace, inputs = capture_with_router_inputs(loaded, SEQS)
    _, width = _batch(SEQS)
    for i, (site, layer) in enumerate(zip(loaded.sites, trace.layers, strict=True)):
        with torch.no_grad():
            hidden = inputs[i].reshape(-1, inputs[i].shape[-1])
            logits = F.linear(hidden, site.router.weight, site.router.bias)
            top, chosen = torch.topk(logits, site.top_k or 2, dim=-1)
            weights = torch.softmax(top, dim=-1, dtype=top.dtype)
        tokens = trace.tokens.iloc[layer.token_rows]
        flat = tokens.seq.to_numpy() * width + tokens.pos.to_numpy()
        assert layer.decision_source == "dispatch"
        np.testing.assert_array_equal(layer.logits, logits.float().numpy()[flat])
        np.testing.assert_array_equal(layer.experts, chosen.numpy()[flat])
        np.testing.assert_array_equal(layer.weights, weights.float().numpy()[flat])


@pytest.mark.parametrize(
    ("quantization", "expected"),
    [
        (
            {"quant_method": "bitsandbytes", "load_in_4bit": True},
            r"bitsandbytes-quantised.*requires bitsandbytes",
        ),
        (
            {"quant_method": "gptq", "bits": 4, "group_size": 128},
            r"gptq-quantised; loading it needs a package",
        ),
        (
            {"quant_method": "no-such-method"},
            r"no-such-method-quantised, which this transformers cannot load",
        ),
    ],
)
def test_quantisations_that_cannot_run_here_are_refused_before_reading_weights(
    tiny_model_dir, tmp_path, monkeypatch, quantization, expected
):
    folder = tmp_path / "quantised"
    shutil.copytree(tiny_model_dir("deepseek_v3"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = quantization
    (folder / "config.json").write_text(json.dumps(config))
    from transformers import AutoModelForCausalLM

    def refuse(*args, **kwargs):
        raise AssertionError("weights were read")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    with pytest.raises(UnsupportedQuantizationError, match=expected) as err:
        moeviz.load_model(folder)
    assert "Nothing was loaded" in str(err.value) and "dequantised (bfloat16) copy" in str(err.value)
