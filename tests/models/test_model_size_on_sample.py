"""The model-size calculator's byte counts on the bundled sample (moeviz.whatif.model_size), by hand. The
published models and the formulas: tests/unit/test_whatif_model_size.py."""

from __future__ import annotations

from moeviz.whatif.model_size import expert_bytes, expert_flops_per_token, model_size


def test_expert_bytes_on_the_sample_by_hand(sample_model):
    experts = sample_model.model.model.layers[0].mlp.experts
    one = sum(p[0].numel() * p.element_size() for p in (experts.gate_up_proj, experts.down_proj))
    assert one == (2 * 128 * 128 + 128 * 128) * 4  # fp32 sample: [2I, H] + [H, I]
    assert expert_bytes(sample_model) == one
    assert expert_bytes(sample_model, "bf16") == one // 2
    # INT8: 1 byte per weight + an fp32 scale per output row (256 + 128 rows)
    assert expert_bytes(sample_model, "int8") == 3 * 128 * 128 + 4 * (256 + 128)
    assert expert_flops_per_token(sample_model) == 2 * 3 * 128 * 128
    assert model_size(sample_model).expert_params == 3 * 128 * 128
