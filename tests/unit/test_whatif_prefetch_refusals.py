"""The prefetch what-if's refusal of a router whose output holds no logits (no model: a stand-in site)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moeviz.errors import CaptureError
from moeviz.whatif.prefetch import predict_experts


def test_router_output_without_logits_is_a_capture_error_naming_the_layer():
    # what MoESite.router_logits returns when no [N, E] float tensor is in the router's output
    site = SimpleNamespace(
        layer=3,
        name="model.layers.3.mlp.gate",
        num_experts=8,
        router=lambda hidden: (hidden.long(),),
        router_logits=lambda output: None,
        router_scores=lambda logits, selection: logits,
    )
    with pytest.raises(CaptureError, match=r"layer 3 \(model\.layers\.3\.mlp\.gate\): no \[N, 8\] logits"):
        predict_experts(site, SimpleNamespace(n_group=None, topk_group=None, k=2), torch.zeros(2, 4))
