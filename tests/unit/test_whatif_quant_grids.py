"""The quantisation what-if's fake-quantisers (moeviz.whatif.quant.fake_quantise) on exact grids: INT8 rows,
FP8 e4m3, INT4 groups of 128, fused expert tensors. The what-if on models:
tests/models/test_whatif_quant.py."""

from __future__ import annotations

import torch

from moeviz.whatif.quant import fake_quantise


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
