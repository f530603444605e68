"""The two torch → numpy helpers of capture, named by their contract: `_fp32_copy` (the attention arrays:
always an fp32, C-contiguous copy the AttentionCapture owns) and `_numpy_view` (the routing arrays: a view
of the tensor wherever it can be)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeviz.capture.attention_build import _fp32_copy
from moeviz.capture.forward import _numpy_view


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(2, 3, 4),  # already fp32 and contiguous: still copied
        lambda: torch.randn(2, 4, 3).transpose(1, 2),  # a strided view
        lambda: torch.randn(2, 3, 4).to(torch.bfloat16),
    ],
    ids=["fp32-contiguous", "strided", "bf16"],
)
def test_fp32_copy_always_copies(make):
    tensor = make()
    out = _fp32_copy(tensor)
    assert out.dtype == np.float32 and out.flags.c_contiguous
    np.testing.assert_array_equal(out, tensor.float().numpy())
    before = out.copy()
    tensor.add_(1)  # the model's tensor changes after the run: the capture's array does not
    np.testing.assert_array_equal(out, before)


def test_numpy_view_shares_the_tensors_memory():
    tensor = torch.randn(3, 4)
    view = _numpy_view(tensor, float32=True)
    tensor.add_(1)
    np.testing.assert_array_equal(view, tensor.numpy())
