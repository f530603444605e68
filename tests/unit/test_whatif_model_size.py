"""Model-size calculator (moeviz.whatif.model_size): published parameter counts of well-known MoE models
(independent figures from their model cards/papers), KV cache per token and byte sizes by hand.
On the bundled sample: tests/models/test_model_size_on_sample.py."""

from __future__ import annotations

import math

import pytest

from moeviz.whatif.model_size import (
    KNOWN_MODELS,
    ModelSize,
    known_model_size,
)

# name -> (total, active) as published
PUBLISHED = {
    "Mixtral-8x7B": (46.7e9, 12.9e9),
    "DeepSeek-V3": (671e9, 37e9),
    "Qwen3-30B-A3B": (30.5e9, 3.3e9),
    "Qwen3-235B-A22B": (235e9, 22e9),
    "OLMoE-1B-7B": (6.9e9, 1.3e9),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_totals(name):
    size = known_model_size(name)
    total, active = PUBLISHED[name]
    assert size.total_params == pytest.approx(total, rel=0.01)
    assert size.active_params == pytest.approx(active, rel=0.03)  # published actives are rounded to 0.1 B


def test_kv_cache_per_token_by_hand():
    mixtral = known_model_size("Mixtral-8x7B")
    assert mixtral.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # GQA: K and V, 8 KV heads of 128
    deepseek = known_model_size("DeepSeek-V3")
    assert deepseek.kv_bytes_per_token == 61 * (512 + 64) * 2  # MLA: latent + RoPE key
    assert (deepseek.routed_experts, deepseek.top_k, deepseek.shared_experts) == (256, 8, 1)
    assert deepseek.moe_layers == 58  # 61 blocks, the first 3 dense
    if "gpt-oss-120b" in KNOWN_MODELS:
        assert any("sliding window" in note for note in known_model_size("gpt-oss-120b").notes)


def test_gpus_needed_by_hand():
    size = ModelSize(
        name="x", total_params=100 * 2**30, active_params=10, expert_params=1, routed_experts=8, top_k=2,
        shared_experts=0, moe_layers=1, layers=1, hidden_size=1, kv_bytes_per_token=2**20,
    )  # fmt: skip
    assert size.weight_bytes("bf16") == 200 * 2**30
    assert size.weight_bytes("int4") == 50 * 2**30
    # bf16: 200 GiB weights + 4096 × 8 × 1 MiB = 32 GiB of KV → 232 GiB over 80 × 0.9 = 72 GiB → 4 GPUs
    assert size.gpus_needed("bf16", context=4096, batch=8, gpu_gib=80) == math.ceil(232 / 72) == 4
    assert size.gpus_needed("int4", context=4096, batch=1, gpu_gib=80, usable=1.0) == 1  # 54 GiB
