"""The aux loss's paradoxes the Routing playground explains (`moeviz.analysis.reroute.Rerouted`), on the
hand-computed 3 × 4 case of tests/unit/test_reroute.py: drops push the loss below its balanced value k; a
bias lowers it while the load worsens (P ignores the bias); temperature keeps every token's experts."""

from __future__ import annotations

import numpy as np
import pytest

from moeviz.analysis.reroute import RerouteSettings, reroute
from tests.support.traces import expert_sets, routed_layer

P = np.array(
    [
        [0.40, 0.30, 0.20, 0.10],
        [0.10, 0.20, 0.30, 0.40],
        [0.35, 0.05, 0.40, 0.20],
    ]
)
CAPTURED_AUX = 19 / 9  # E·Σ f P with f = [2, 1, 2, 1] / 3, P = [.85, .55, .9, .7] / 3 (test_reroute.py)


def _layer(probs: np.ndarray = P, k: int = 2):
    """A softmax layer whose scores are `probs` (logits = log p), routed top-k renormalised."""
    return routed_layer(np.log(probs), k)


def test_drops_lower_the_aux_loss_below_k() -> None:
    # C = ceil(3·2/4 · 0.5) = 1: experts 0 and 2 (2 slots each) drop one; f = [1, 1, 1, 1] / 3, so
    # E·Σ f P = 4 · (1/3) · Σ P = 4/3 < k = 2, and Σ f = (6 − 2) / 3
    r = reroute(_layer(), RerouteSettings(k=2, capacity_factor=0.5))
    assert r.dropped_slots == 2 and r.aux_loss_dispatched == pytest.approx(4 / 3, rel=1e-6)
    assert r.dispatched_per_token == pytest.approx(4 / 3) and r.drops_lower_aux_loss
    assert not reroute(_layer(), RerouteSettings(k=2)).drops_lower_aux_loss  # no drops: the loss is 19/9


def test_drops_on_a_collapsed_router_leave_the_loss_above_k() -> None:
    # every token's best expert is 0 (p = .97): C = ceil(4·1/4 · 3) = 3 keeps 3 of 4 slots, f_0 = 3/4, so
    # E·Σ f P = 4 · 3/4 · .97 = 2.91 > k = 1: drops, but no paradox to explain
    collapsed = np.tile([0.97, 0.01, 0.01, 0.01], (4, 1))
    r = reroute(_layer(collapsed, k=1), RerouteSettings(k=1, capacity_factor=3.0))
    assert r.dropped_slots == 1 and r.aux_loss_dispatched == pytest.approx(2.91, rel=1e-5)
    assert not r.drops_lower_aux_loss


def test_a_bias_on_a_low_p_expert_lowers_the_loss_while_the_load_worsens() -> None:
    # +1 on expert 1 (smallest P): every token takes it and its best other expert: {0,1}, {1,3}, {1,2};
    # load [1, 3, 1, 1] (busiest 3 > 2), E·Σ f P = 4/9 · (.85 + 3·.55 + .9 + .7) = 4/9 · 4.1 < 19/9
    r = reroute(_layer(), RerouteSettings(k=2, bias=np.array([0.0, 1.0, 0.0, 0.0])))
    assert expert_sets(r.experts) == [{0, 1}, {1, 3}, {1, 2}] and r.load.tolist() == [1, 3, 1, 1]
    assert r.aux_loss_dispatched == pytest.approx(4 / 9 * 4.1, rel=1e-6)
    assert r.aux_loss_dispatched < r.captured_aux_loss_dispatched == pytest.approx(CAPTURED_AUX, rel=1e-6)
    assert r.bias_changed and r.bias_lowers_aux_loss_not_load


def test_a_bias_that_raises_the_loss_or_comes_with_other_changes_is_not_the_paradox() -> None:
    # +1 on expert 2 (largest P): {0,2}, {2,3}, {0,2}; load [2, 0, 3, 1], 4/9 · (1.7 + 2.7 + .7) > 19/9
    raised = reroute(_layer(), RerouteSettings(k=2, bias=np.array([0.0, 0.0, 1.0, 0.0])))
    assert raised.aux_loss_dispatched == pytest.approx(4 / 9 * 5.1, rel=1e-6)
    assert raised.aux_loss_dispatched > raised.captured_aux_loss_dispatched
    assert not raised.bias_lowers_aux_loss_not_load
    low_p = np.array([0.0, 1.0, 0.0, 0.0])
    # a temperature changes P too, and k = 3 has another balanced value: the bias is not alone
    assert not reroute(
        _layer(), RerouteSettings(k=2, bias=low_p, temperature=2.0)
    ).bias_lowers_aux_loss_not_load
    assert not reroute(_layer(), RerouteSettings(k=3, bias=low_p)).bias_lowers_aux_loss_not_load
    unchanged = reroute(_layer(), RerouteSettings(k=2, bias=np.zeros(4)))  # zeros = no bias
    assert not unchanged.bias_changed and not unchanged.bias_lowers_aux_loss_not_load


@pytest.mark.parametrize("score_fn", ["softmax", "sigmoid"])
@pytest.mark.parametrize("temperature", [0.1, 0.5, 3.0])
def test_temperature_keeps_every_token_s_experts(score_fn: str, temperature: float) -> None:
    settings = RerouteSettings(k=2, score_fn=score_fn)
    at_one = reroute(_layer(), settings)
    r = reroute(_layer(), RerouteSettings(k=2, score_fn=score_fn, temperature=temperature))
    assert expert_sets(r.experts) == expert_sets(at_one.experts)  # the order of the logits is kept
    assert r.temperature_changed_tokens == 0 and r.temperature_keeps_choice
    assert r.at_temperature_one.aux_loss_dispatched == at_one.aux_loss_dispatched
    assert not at_one.temperature_keeps_choice  # τ = 1: nothing to explain


def test_with_a_bias_the_temperature_moves_tokens() -> None:
    # flatter scores (τ = 5) let the bias on expert 3 win where the scores decided at τ = 1
    bias = np.array([0.0, 0.0, 0.0, 0.15])
    at_one = reroute(_layer(), RerouteSettings(k=1, bias=bias))
    flat = reroute(_layer(), RerouteSettings(k=1, bias=bias, temperature=5.0))
    moved = sum(a != b for a, b in zip(expert_sets(at_one.experts), expert_sets(flat.experts), strict=True))
    assert moved > 0 and flat.temperature_changed_tokens == moved and not flat.temperature_keeps_choice
