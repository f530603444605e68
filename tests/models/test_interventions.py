"""Counterfactual routing through hooks: exactness, hand-computed effects, isolation and clean-up."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import moeviz
from moeviz.interventions import (
    DisableExpert,
    ForceExpert,
    ForceRouting,
    InterventionError,
    NextBest,
    counterfactual,
    expert_importance,
    intervening,
    next_token_logprobs,
)
from moeviz.interventions.hooks import installed_hook_count

IDS = [5, 17, 33, 9, 60, 21, 44, 8, 71, 12]


@pytest.fixture(scope="module")
def mixtral(tiny_model_dir):
    return moeviz.load_model(tiny_model_dir("mixtral"))


@pytest.fixture(scope="module")
def deepseek(tiny_model_dir):
    return moeviz.load_model(tiny_model_dir("deepseek_v3"))


def _logprobs(loaded, ids, interventions=()):
    batch = torch.tensor([ids])
    if not interventions:
        return next_token_logprobs(loaded, batch)
    with intervening(loaded, interventions, len(ids)):
        return next_token_logprobs(loaded, batch)


def test_disabling_an_unused_expert_changes_nothing_bitwise(mixtral):
    ids = IDS[:3]
    trace = moeviz.capture(mixtral, token_ids=[ids])
    layer = trace.layers[0]
    unused = sorted(set(range(layer.num_experts)) - set(layer.experts.ravel().tolist()))
    assert unused, "3 tokens x top-2 of 8 experts leaves experts unused"
    base = _logprobs(mixtral, ids)
    after = _logprobs(mixtral, ids, [DisableExpert(expert=unused[0], layer=layer.layer)])
    assert torch.equal(base, after)
    used = int(layer.experts[0, 0])
    changed = _logprobs(mixtral, ids, [DisableExpert(expert=used, layer=layer.layer)])
    assert not torch.equal(base, changed)


@pytest.mark.parametrize("family", ["mixtral", "deepseek"])
def test_reinjecting_captured_routing_reproduces_output_exactly(family, request):
    loaded = request.getfixturevalue(family)
    trace = moeviz.capture(loaded, token_ids=[IDS])
    forced = [ForceRouting(layer=r.layer, experts=r.experts, weights=r.weights) for r in trace.layers]
    if family == "mixtral":  # its experts add slots per expert, so slot order cannot matter: bitwise
        assert torch.equal(_logprobs(loaded, IDS), _logprobs(loaded, IDS, forced))
    else:  # the Trace keeps slots by descending weight, not the model's order: equal up to float rounding
        torch.testing.assert_close(_logprobs(loaded, IDS), _logprobs(loaded, IDS, forced), atol=2e-6, rtol=0)
    # and a routing that is not the captured one does change it
    other = [
        ForceRouting(layer=r.layer, experts=np.roll(r.experts, 1, axis=0), weights=r.weights)
        for r in trace.layers
    ]
    assert not torch.equal(_logprobs(loaded, IDS), _logprobs(loaded, IDS, other))


def _expert_by_hand(experts_module, expert: int, hidden: torch.Tensor) -> torch.Tensor:
    gate, up = torch.nn.functional.linear(hidden, experts_module.gate_up_proj[expert]).chunk(2, dim=-1)
    return torch.nn.functional.linear(experts_module.act_fn(gate) * up, experts_module.down_proj[expert])


def test_forcing_changes_the_layer_output_as_recomputed_by_hand(mixtral):
    site = mixtral.sites[1]
    seen = []
    handle = site.experts.register_forward_hook(lambda m, a, out: seen.append((a[0].detach(), out.detach())))
    try:
        trace = moeviz.capture(mixtral, token_ids=[IDS])
        routing = trace.layer(site.layer)
        t = 4
        old = int(routing.experts[t, 0])
        new = next(e for e in range(routing.num_experts) if e not in routing.experts[t])
        _logprobs(mixtral, IDS, [ForceExpert(expert=new, layer=site.layer, positions=t)])
    finally:
        handle.remove()
    (hidden, before), (hidden_after, after) = seen[0], seen[-1]
    assert torch.equal(hidden, hidden_after)  # the layer's input is upstream of the intervention
    with torch.no_grad():
        delta = _expert_by_hand(site.experts, new, hidden[t]) - _expert_by_hand(site.experts, old, hidden[t])
    expected = before.clone()
    expected[t] += float(routing.weights[t, 0]) * delta
    torch.testing.assert_close(after, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(after[t], before[t])
    others = [i for i in range(len(IDS)) if i != t]
    torch.testing.assert_close(after[others], before[others], atol=1e-6, rtol=0)


def test_counterfactual_reports_later_layers_and_tokens(deepseek):
    layer = deepseek.sites[0].layer
    result = counterfactual(deepseek, token_ids=IDS, interventions=[NextBest(layer=layer, positions=3)])
    changes = result.routing_changes()
    here = changes[(changes.layer == layer)]
    assert here.changed.tolist() == [p == 3 for p in range(len(IDS))]  # only the chosen token, its slot
    assert (here.score_change == 0).all()  # the router itself saw the same input
    later = changes[(changes.layer > layer) & (changes.pos < 3)]
    assert (later.score_change < 1e-5).all()  # causal: earlier tokens cannot change (float regrouping aside)
    assert changes[(changes.layer > layer) & (changes.pos >= 3)].score_change.max() > 1e-3
    assert result.token_frame().shape[0] == len(IDS) - 1
    assert np.isfinite(result.next_logprob_change)


def test_disable_for_one_token_only_touches_that_token_at_that_layer(mixtral):
    trace = moeviz.capture(mixtral, token_ids=[IDS])
    routing = trace.layers[0]
    expert = int(routing.experts[2, 0])
    result = counterfactual(
        mixtral, token_ids=IDS, interventions=[DisableExpert(expert=expert, layer=routing.layer, positions=2)]
    )
    after = result.after.layer(routing.layer)
    for t in range(len(IDS)):  # slots are ordered by weight, so compare expert -> weight maps
        got = dict(zip(after.experts[t].tolist(), after.weights[t].tolist(), strict=True))
        want = dict(zip(routing.experts[t].tolist(), routing.weights[t].tolist(), strict=True))
        if t == 2:
            want[expert] = 0.0
        assert got == want, t


def test_unsupported_family_is_a_clear_error(tiny_model_dir):
    loaded = moeviz.load_model(tiny_model_dir("llama4_text"))
    with pytest.raises(InterventionError, match="unsupported"):
        counterfactual(loaded, token_ids=IDS, interventions=[DisableExpert(expert=0)])


def test_bad_specs_are_clear_errors(mixtral):
    with pytest.raises(InterventionError, match="no MoE layer 7"):
        counterfactual(mixtral, token_ids=IDS, interventions=[DisableExpert(expert=0, layer=7)])
    with pytest.raises(InterventionError, match="expert 99 out of range"):
        counterfactual(mixtral, token_ids=IDS, interventions=[DisableExpert(expert=99)])


def test_hooks_are_removed_on_error_and_other_threads_are_untouched(mixtral):
    base = _logprobs(mixtral, IDS)
    with pytest.raises(InterventionError, match="outside the sequence"):
        _logprobs(mixtral, IDS, [DisableExpert(expert=0, positions=50)])
    assert installed_hook_count(mixtral.model) == 0
    assert all(not s.experts._forward_pre_hooks and not s.router._forward_hooks for s in mixtral.sites)
    other: list[torch.Tensor] = []
    with intervening(mixtral, [DisableExpert(expert=e) for e in range(3)], len(IDS)):
        thread = threading.Thread(
            target=lambda: other.append(next_token_logprobs(mixtral, torch.tensor([IDS])))
        )
        thread.start()
        thread.join()
        mine = next_token_logprobs(mixtral, torch.tensor([IDS]))
    assert torch.equal(other[0], base)
    assert not torch.equal(mine, base)
    assert installed_hook_count(mixtral.model) == 0


def test_expert_importance_matches_single_runs(mixtral):
    frame = expert_importance(mixtral, token_ids=IDS, batch_size=3)
    assert set(frame.columns) >= {"layer", "expert", "load", "weighted_load", "loss", "delta_loss"}
    assert len(frame) == sum(s.num_experts for s in mixtral.sites)
    np.testing.assert_allclose(frame.groupby("layer").load.sum(), 1.0, rtol=1e-6)
    unused = frame[frame.tokens == 0]
    np.testing.assert_allclose(unused.delta_loss, 0.0, atol=1e-5)
    row = frame.loc[frame.delta_loss.abs().idxmax()]
    lp = _logprobs(mixtral, IDS, [DisableExpert(expert=int(row.expert), layer=int(row.layer))])[0]
    loss = float(-lp[:-1].gather(1, torch.tensor(IDS[1:])[:, None]).mean())
    assert loss == pytest.approx(row.loss, abs=1e-4)
