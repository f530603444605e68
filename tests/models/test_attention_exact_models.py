"""The fused streaming attention pass on real captures (the sample and tiny models of the attention
families) against the float64 statistics of full maps (tests/support/attention_reference.py). The
synthetic cases: tests/unit/test_attention_exact.py."""

from __future__ import annotations

import pytest
import torch

import moeviz
from tests.support.attention_reference import TOLERANCE, deviation


def test_sample_model_within_1e6_of_float64(sample_model):
    ids = torch.randint(3, 2048, (1, 600), generator=torch.Generator().manual_seed(0))[0].tolist()
    att = moeviz.capture(sample_model, token_ids=[ids, ids[:333]], attention=True).attention
    assert deviation(att) <= TOLERANCE  # 600 tokens: past the 256-key sliding window


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss", "llama4_text", "deepseek_v3"])
def test_tiny_families_within_1e6_of_float64(tiny_model_dir, family):
    loaded = moeviz.load_model(tiny_model_dir(family))
    gen = torch.Generator().manual_seed(1)
    batch = [torch.randint(3, 120, (n,), generator=gen).tolist() for n in (40, 23)]
    att = moeviz.capture(loaded, token_ids=batch, attention=True).attention
    assert deviation(att) <= TOLERANCE
