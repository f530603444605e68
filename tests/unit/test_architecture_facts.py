"""The About page's architecture facts (moeviz.architecture): the group limit and the routed scaling factor of
every MoE layer — read off the captured weights, or the config where the weights do not show it — and the
active-parameter count's input embedding, each against a computation of its own on a synthetic trace or a
hand-built module (no model)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import torch

from moeviz.architecture import (
    group_limit,
    layer_facts_frame,
    parameter_summary,
    routed_scaling,
    scaling_summary,
    weight_sum,
)
from moeviz.models.config_keys import ROUTED_SCALING_KEYS, config_float
from moeviz.scoring import scores_from_logits
from moeviz.testing.scale_traces import synthetic_trace
from moeviz.trace import Trace


def _trace(**overrides) -> Trace:
    """A DeepSeek-V3-shaped synthetic trace, small: 4 MoE layers (block 0 dense), 64 tokens; its weights are
    the renormalised sigmoid scores × 2.5, as DeepSeek-V3 routes."""
    shape = dict(num_experts=64, k=8, n_group=8, topk_group=4, num_blocks=5, first_dense=1, num_tokens=64)
    return synthetic_trace(**{**shape, **overrides})


def _unnormalised(trace: Trace, index: int) -> Trace:
    """`trace` with layer `index`'s weights the chosen experts' sigmoid scores, not renormalised (a router
    without norm_topk_prob): every token's weights then sum to a different value."""
    routing = trace.layers[index]
    scores = scores_from_logits(routing.logits, "sigmoid")
    weights = np.take_along_axis(scores, routing.experts, axis=1).astype(np.float32)
    layers = list(trace.layers)
    layers[index] = dataclasses.replace(routing, weights=weights)
    return Trace(model=trace.model, tokens=trace.tokens, layers=layers)


# ---- the config reader -------------------------------------------------------------------------------------
def test_config_float_reads_the_first_real_number_of_the_keys() -> None:
    assert config_float({"routed_scaling_factor": 2.5}, ROUTED_SCALING_KEYS) == 2.5
    assert (
        config_float({"routed_scaling_factor": None, "router_scaling_factor": 16}, ROUTED_SCALING_KEYS)
        == 16.0
    )
    assert config_float({"routed_scaling_factor": True}, ROUTED_SCALING_KEYS) is None  # a flag, not a factor
    config = type("Config", (), {"moe_routed_scaling_factor": 1.8})()
    assert config_float(config, ROUTED_SCALING_KEYS) == 1.8
    assert config_float({}, ROUTED_SCALING_KEYS) is None


# ---- group limit and routed scaling, per layer ------------------------------------------------------------
def test_each_layer_lists_its_group_limit_and_routed_scaling() -> None:
    trace = _trace()
    facts = layer_facts_frame(trace)
    assert facts["layer"].tolist() == [r.layer for r in trace.layers]
    assert facts["n_group"].tolist() == [r.n_group for r in trace.layers] == [8] * 4
    assert facts["topk_group"].tolist() == [r.topk_group for r in trace.layers] == [4] * 4
    # every token's weights sum to the factor: computed here from the weights themselves
    for routing, scale in zip(trace.layers, facts["routed_scaling"], strict=True):
        sums = routing.weights.sum(axis=1, dtype=np.float64)
        np.testing.assert_allclose(sums, scale, rtol=1e-3)
    assert group_limit(facts) == "best 4 of 8 groups"
    assert scaling_summary(facts) == "× 2.5"


def test_routed_scaling_falls_back_on_the_config_where_the_weights_are_not_renormalised() -> None:
    trace = _unnormalised(_trace(), 1)
    sums = trace.layers[1].weights.sum(axis=1, dtype=np.float64)
    assert sums.max() / sums.min() > 1.05  # the weights do not share a sum: they cannot tell the factor
    assert weight_sum(trace.layers[1]) is None
    facts = layer_facts_frame(trace)
    assert pd.isna(facts["routed_scaling"].iloc[1]) and facts["routed_scaling"].drop(1).eq(2.5).all()
    assert scaling_summary(facts) == "× 2.5 (3 of 4 MoE layers)"
    config = {"routed_scaling_factor": 2.5, "n_routed_experts": 64}
    assert routed_scaling(trace.layers[1], config) == 2.5
    assert layer_facts_frame(trace, config)["routed_scaling"].tolist() == [2.5] * 4


def test_a_router_without_groups_or_scaling() -> None:
    trace = _trace(n_group=1, topk_group=1)
    layers = [
        dataclasses.replace(r, weights=(r.weights / r.weights.sum(axis=1, keepdims=True)).astype(np.float32))
        for r in trace.layers
    ]
    facts = layer_facts_frame(Trace(model=trace.model, tokens=trace.tokens, layers=layers))
    assert facts["n_group"].isna().all() and facts["topk_group"].isna().all()
    assert facts["routed_scaling"].tolist() == [1.0] * 4  # renormalised, unscaled: the weights sum to 1
    assert group_limit(facts) == "none"
    assert scaling_summary(facts) == "× 1"


# ---- the input embedding in the active count ------------------------------------------------------------
class _TinyMoE(torch.nn.Module):
    """An embedding, one layer of E = 4 routed experts (k = 2) and an output head, tied or not: the parts the
    active count weighs, with sizes chosen here."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.config = type("Config", (), {"num_local_experts": 4, "num_experts_per_tok": 2})()
        self.embed = torch.nn.Embedding(100, 6)
        self.block = torch.nn.Module()
        self.block.experts = torch.nn.ModuleList(torch.nn.Linear(6, 6, bias=False) for _ in range(4))
        self.block.attention = torch.nn.Linear(6, 6, bias=False)
        self.head = torch.nn.Linear(6, 100, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.embed

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.head


def test_active_count_says_how_much_of_it_is_the_input_embedding() -> None:
    summary = parameter_summary(_TinyMoE(tied=False))
    embedding, experts, attention, head = 100 * 6, 4 * 36, 36, 600
    assert summary["total"] == embedding + experts + attention + head
    assert summary["active"] == embedding + experts // 2 + attention + head  # k/E = 1/2 of the experts
    assert summary["input_embedding"] == embedding
    assert summary["active_without_input_embedding"] == experts // 2 + attention + head


def test_a_tied_embedding_is_the_output_head_and_stays_active() -> None:
    summary = parameter_summary(_TinyMoE(tied=True))
    assert summary["total"] == 600 + 4 * 36 + 36  # the shared matrix once
    assert summary["input_embedding"] == 0
    assert summary["active_without_input_embedding"] == summary["active"]
