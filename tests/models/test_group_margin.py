"""Top-k margins of group-limited sigmoid routers (DeepSeek-V3): competitors are the eligible experts of the
token's chosen groups, not all experts. Checked against an independent torch re-implementation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import moeviz
from moeviz.analysis.confidence import decision_set, eligible_experts, layer_confidence, topk_margin
from moeviz.trace import Trace
from tests.support.reference_routing import reference_routing

# Like the deepseek-v3-bias sample: 16 experts in 4 groups, top-4 from the best 2 groups.
GROUPED = dict(n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4)
SEQS = [list(range(3, 27)), list(range(30, 54))]  # equal lengths: no padding, rows in batch·seq order


def reference_margin(
    logits: np.ndarray, bias: np.ndarray, experts: np.ndarray, config, *, biased: bool
) -> np.ndarray:
    """(min_S v − max_{eligible∖S} v) / min_S v clipped at 0, with v = sigmoid + bias (`biased`) or the
    plain sigmoid p (its normalisation to sum 1 cancels in the ratio). Eligible = the experts of the best
    `topk_group` groups, a group scored by the sum of its two best sigmoid + bias, as the model chooses."""
    p = torch.sigmoid(torch.from_numpy(logits).float())
    select = p + torch.from_numpy(bias.astype(np.float32))
    values = select if biased else p
    n, e = p.shape
    size = e // config.n_group
    group_scores = select.view(n, config.n_group, size).topk(2, dim=-1).values.sum(-1)
    groups = group_scores.topk(config.topk_group, dim=-1).indices
    eligible = torch.zeros(n, config.n_group, dtype=torch.bool).scatter_(1, groups, True)
    eligible = eligible.repeat_interleave(size, dim=1)
    in_s = torch.zeros(n, e, dtype=torch.bool).scatter_(1, torch.from_numpy(experts).long(), True)
    inside = values.masked_fill(~in_s, float("inf")).min(dim=1).values
    outside = values.masked_fill(~eligible | in_s, float("-inf")).max(dim=1).values
    return ((inside - outside) / inside).clamp(min=0).numpy()


@pytest.fixture(scope="module")
def grouped(tiny_model_dir):
    loaded = moeviz.load_model(tiny_model_dir("deepseek_v3", **GROUPED))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # small positive biases: every min over S of p + b is > 0, so no margin is NaN
        for name, buf in loaded.model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.rand(buf.shape, generator=gen) * 0.2)
    trace = moeviz.capture(loaded, token_ids=SEQS)
    ids = torch.tensor(SEQS)
    ref = reference_routing(loaded.model, "deepseek_v3", input_ids=ids, attention_mask=torch.ones_like(ids))
    return loaded, trace, ref


def test_grouped_router_facts_are_recorded_and_round_trip(grouped, tmp_path):
    _, trace, _ = grouped
    assert trace.layers
    for routing in trace.layers:
        assert (routing.n_group, routing.topk_group, routing.group_score) == (4, 2, "top2_sum")
    back = Trace.from_parquet(trace.to_parquet(tmp_path / "t.parquet"))
    assert [(r.n_group, r.topk_group, r.group_score) for r in back.layers] == [(4, 2, "top2_sum")] * len(
        trace.layers
    )


def test_selection_margin_is_over_the_eligible_experts_of_the_chosen_groups(grouped):
    loaded, trace, ref = grouped
    config = loaded.model.config
    for routing in trace.layers:
        logits, experts = ref[routing.key].logits, ref[routing.key].experts
        np.testing.assert_array_equal(np.sort(routing.experts, 1), np.sort(experts, 1))
        conf = layer_confidence(routing)
        expected = reference_margin(logits, routing.bias, experts, config, biased=True)
        np.testing.assert_allclose(conf.margin_selection, expected, rtol=1e-5, atol=1e-6)
        expected = reference_margin(logits, routing.bias, experts, config, biased=False)
        np.testing.assert_allclose(conf.margin, expected, rtol=1e-5, atol=1e-6)


def test_grouped_margin_is_no_longer_zero(grouped):
    """Over all experts a strong expert of an unchosen group outranks the weakest chosen one, so a margin
    taken over all of them is 0 for many tokens; over the eligible experts it is a real, positive value."""
    _, trace, _ = grouped
    old_zero = new_zero = total = 0
    for routing in trace.layers:
        conf = layer_confidence(routing)
        old = topk_margin(routing.selection_scores, decision_set(routing), empty_outside=None)
        assert not np.isnan(conf.margin_selection).any()
        assert (conf.margin_selection >= old - 1e-7).all()  # fewer competitors: never a smaller margin
        old_zero += int((old == 0).sum())
        new_zero += int((conf.margin_selection == 0).sum())
        total += len(old)
    assert old_zero > 0.2 * total
    assert new_zero < 0.05 * total
    frame = moeviz.analysis.confidence_frame(trace)
    assert frame["margin_selection"].median() > 0


def test_ungrouped_layers_keep_the_all_expert_margin(tiny_model_dir):
    """Mixtral-like routers record no group limit, and their margins are unchanged."""
    loaded = moeviz.load_model(tiny_model_dir("mixtral"))
    trace = moeviz.capture(loaded, token_ids=SEQS)
    for routing in trace.layers:
        assert routing.n_group is None
        conf = layer_confidence(routing)
        probs = moeviz.analysis.router_probs(routing)
        np.testing.assert_array_equal(conf.margin, topk_margin(probs, decision_set(routing)))


@pytest.mark.parametrize("overrides", [{}, dict(topk_group=2, num_experts_per_tok=3)])
def test_deepseek_v2_groups_score_by_their_max(tiny_model_dir, overrides):
    """V2's group-limited greedy: softmax, a group scored by its best expert, no bias. The margin on p is
    over the experts of the chosen group(s) only."""
    loaded = moeviz.load_model(tiny_model_dir("deepseek_v2", **overrides))
    trace = moeviz.capture(loaded, token_ids=SEQS)
    config = loaded.model.config
    for routing in trace.layers:
        assert (routing.n_group, routing.topk_group, routing.group_score) == (4, config.topk_group, "max")
        eligible = eligible_experts(routing)
        assert np.take_along_axis(eligible, routing.experts, axis=1).all()  # the decision is eligible
        p = routing.scores
        size = p.shape[1] // config.n_group
        group_best = p.reshape(len(p), config.n_group, size).max(axis=2)
        chosen = np.argsort(-group_best, axis=1, kind="stable")[:, : config.topk_group]
        expected = np.zeros_like(eligible)
        for t, groups in enumerate(chosen):
            for g in groups:
                expected[t, g * size : (g + 1) * size] = True
        np.testing.assert_array_equal(eligible, expected)
        inside = np.take_along_axis(p, routing.experts, axis=1).min(axis=1)
        outside = np.where(eligible, p, -np.inf)
        np.put_along_axis(outside, routing.experts, -np.inf, axis=1)
        # with k = all eligible experts no competitor is left: the max over the empty set is 0 (margin 1)
        best_outside = np.where(np.isfinite(outside.max(axis=1)), outside.max(axis=1), 0)
        margin = np.clip((inside - best_outside) / inside, 0, None)
        np.testing.assert_allclose(layer_confidence(routing).margin, margin, rtol=1e-5, atol=1e-6)
