"""Cost before compute: estimates count the forwards the actions really run, a callback between decoder
layers cancels a run within one layer and leaves no hooks behind, importance sweeps take layer and expert
subsets, and a what-if that cannot change anything is refused without a forward."""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest
import torch

import moeviz
from moeviz.capture.layer_progress import decoder_layers, layer_progress
from moeviz.capture.layer_progress import installed_hook_count as layer_hook_count
from moeviz.errors import InputError
from moeviz.interventions import (
    DisableExpert,
    ForceExpert,
    NextBest,
    counterfactual,
    expert_importance,
    intervening,
    next_token_logprobs,
)
from moeviz.interventions.cost import (
    ForwardTiming,
    format_seconds,
    importance_cost,
    prefetch_cost,
    quantisation_cost,
    whatif_cost,
)
from moeviz.interventions.counterfactual import (
    NoEffectError,
    busiest_experts,
    importance_plan,
    no_effect_reason,
)
from moeviz.interventions.hooks import installed_hook_count as intervention_hook_count
from moeviz.whatif.prefetch import prefetch_recall
from moeviz.whatif.quant import quantisation_flips

IDS = [5, 17, 33, 9, 60, 21, 44, 8, 71, 12]
SHORT = [5, 17, 33]  # 3 tokens × top-2 of 8 experts: some experts never dispatched
TIMING = ForwardTiming(seconds=1.0, tokens=10)  # 0.1 s a token


@pytest.fixture(scope="module")
def mixtral(tiny_model_dir):
    return moeviz.load_model(tiny_model_dir("mixtral"))


@contextmanager
def counting_forwards(model):
    """Every top-level forward of `model` in the block: the number of tokens (B × S) it carried."""
    calls: list[int] = []

    def pre(_module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        calls.append(int(ids.numel()))

    handle = model.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        yield calls
    finally:
        handle.remove()


def _logprobs(loaded, ids, interventions=()):
    batch = torch.tensor([ids])
    if not interventions:
        return next_token_logprobs(loaded, batch)
    with intervening(loaded, interventions, len(ids)):
        return next_token_logprobs(loaded, batch)


def _no_hooks_left(loaded) -> None:
    assert layer_hook_count(loaded.model) == 0
    assert intervention_hook_count(loaded.model) == 0
    for module in loaded.model.modules():
        assert not module._forward_pre_hooks and not module._forward_hooks, type(module).__name__


# ---- estimates count what runs ---------------------------------------------------------------------------
def test_whatif_estimate_counts_the_forwards_counterfactual_runs(mixtral):
    routing = moeviz.capture(mixtral, token_ids=[IDS]).layers[0]
    spec = DisableExpert(expert=int(routing.experts[2, 0]), layer=routing.layer, positions=2)
    with counting_forwards(mixtral.model) as calls:
        counterfactual(mixtral, token_ids=IDS, interventions=[spec])
    estimate = whatif_cost(TIMING, len(IDS))
    assert (estimate.forwards, estimate.tokens) == (len(calls), sum(calls)) == (2, 2 * len(IDS))
    assert estimate.seconds == pytest.approx(sum(calls) * TIMING.per_token)


def test_importance_estimate_counts_the_forwards_of_a_subset_sweep(mixtral):
    trace = moeviz.capture(mixtral, token_ids=[IDS])
    layer = mixtral.sites[1].layer
    plans = importance_plan(mixtral.sites, trace, layers=[layer], experts=[0, 1, 2, 3, 4, 5, 6])
    with counting_forwards(mixtral.model) as calls:
        expert_importance(mixtral, token_ids=IDS, layers=[layer], experts=range(7), batch_size=3)
    estimate = importance_cost(TIMING, len(IDS), [len(p.measured) for p in plans], batch_size=3)
    assert (estimate.forwards, estimate.tokens) == (len(calls), sum(calls))


def test_quantisation_and_prefetch_estimates_count_their_forwards(mixtral):
    batch = [IDS, IDS[:4], IDS[:7]]
    with counting_forwards(mixtral.model) as calls:
        quantisation_flips(mixtral, token_ids=batch, dtype="int8", target="experts")
    # the quantised copy (a deep copy without hooks) runs the same forwards as the original: count these
    estimate = quantisation_cost(TIMING, list(map(len, batch)), quantise_seconds=0.5)
    routed, scored = 1, len(batch)  # one batch of ≤ 8 sequences; one next-token forward per sequence
    assert len(calls) == routed + scored and estimate.forwards == 2 * (routed + scored)
    assert estimate.tokens == 2 * sum(calls)
    assert estimate.seconds == pytest.approx(estimate.tokens * TIMING.per_token + 0.5)
    with counting_forwards(mixtral.model) as calls:  # one sequence: its routing forward also scores it
        quantisation_flips(mixtral, token_ids=IDS, dtype="int8", target="experts")
    alone = quantisation_cost(TIMING, [len(IDS)], quantise_seconds=0.0)
    assert calls == [len(IDS)] and (alone.forwards, alone.tokens) == (2, 2 * len(IDS))
    with counting_forwards(mixtral.model) as calls:
        prefetch_recall(mixtral, token_ids=batch)
    estimate = prefetch_cost(TIMING, list(map(len, batch)))
    assert (estimate.forwards, estimate.tokens) == (len(calls), sum(calls))


def test_estimate_text_and_seconds():
    assert str(whatif_cost(TIMING, 28)) == "2 forwards (56 tokens) ≈ 5.6 s"
    assert [format_seconds(s) for s in (0.042, 3.21, 45.4, 245, 7800)] == [
        "0.04 s",
        "3.2 s",
        "45 s",
        "4 min 5 s",
        "2 h 10 min",
    ]


# ---- cancel between layers -------------------------------------------------------------------------------
class Cancelled(Exception):
    pass


@pytest.mark.parametrize("where", ["first forward", "second forward", "last layer"])
def test_a_callback_that_raises_stops_the_forward_at_that_layer_and_leaves_no_hooks(mixtral, where):
    layers = decoder_layers(mixtral.model)
    assert len(layers) == mixtral.info.num_layers > 1
    n = len(layers)
    stop_at = {"first forward": 1, "second forward": n + 1, "last layer": 2 * n - 1}[where]
    before = moeviz.capture(mixtral, token_ids=[IDS])
    ran: list[int] = []  # an independent record: a forward hook of the test's own on every decoder layer
    handles = [m.register_forward_hook(lambda *_a, i=i: ran.append(i)) for i, m in enumerate(layers)]
    seen: list[float] = []

    def progress(fraction: float, message: str) -> None:
        seen.append(fraction)
        if len(seen) > stop_at:
            raise Cancelled(message)

    routing = before.layers[0]
    spec = DisableExpert(expert=int(routing.experts[0, 0]), layer=routing.layer)
    try:
        with pytest.raises(Cancelled, match="what-if"):
            counterfactual(mixtral, token_ids=IDS, interventions=[spec], progress=progress)
    finally:
        for handle in handles:
            handle.remove()
    # the callback runs before each layer: after `stop_at` layers ran, the next one never did
    assert len(ran) == stop_at
    assert ran == [i % len(layers) for i in range(stop_at)]
    assert seen == pytest.approx([(i + 1) / (2 * len(layers)) for i in range(stop_at + 1)])
    _no_hooks_left(mixtral)
    after = moeviz.capture(mixtral, token_ids=[IDS])
    for a, b in zip(before.layers, after.layers, strict=True):
        np.testing.assert_array_equal(a.experts, b.experts)
        np.testing.assert_array_equal(a.weights, b.weights)


def test_importance_and_quantisation_stop_within_a_layer(mixtral):
    layers = decoder_layers(mixtral.model)

    def stop_after(n):
        count = [0]

        def progress(_f, _m):
            count[0] += 1
            if count[0] > n:
                raise Cancelled

        return progress, count

    base = _logprobs(mixtral, IDS)
    progress, count = stop_after(len(layers) + 2)  # the capture, then 2 layers into the first sweep forward
    with pytest.raises(Cancelled):
        expert_importance(mixtral, token_ids=IDS, progress=progress)
    assert count[0] == len(layers) + 3
    _no_hooks_left(mixtral)
    # the quantised copy's forwards reach the callback too (the copy's own layers are watched)
    progress, count = stop_after(len(layers) + 1)  # into the quantised copy's forward, its second
    ticks = []
    with pytest.raises(Cancelled), layer_progress(mixtral.model, progress, forwards=2):
        quantisation_flips(mixtral, token_ids=IDS, progress=lambda _f, m: ticks.append(m))
    assert "routing the quantised model" in ticks
    _no_hooks_left(mixtral)
    assert torch.equal(_logprobs(mixtral, IDS), base)


# ---- refuse what cannot change anything -----------------------------------------------------------------
def test_disabling_an_expert_no_token_dispatches_is_refused_without_a_forward(mixtral):
    trace = moeviz.capture(mixtral, token_ids=[SHORT])
    routing = trace.layers[0]
    unused = sorted(set(range(routing.num_experts)) - set(routing.experts.ravel().tolist()))
    assert unused
    spec = DisableExpert(expert=unused[0], layer=routing.layer, site=routing.site)
    # independently: it really changes nothing
    assert torch.equal(_logprobs(mixtral, SHORT, [spec]), _logprobs(mixtral, SHORT))
    reason = no_effect_reason(trace, [spec])
    assert reason == (
        f"expert {unused[0]} is not dispatched by any token at layer {routing.layer}: disabling it cannot "
        "change anything"
    )
    with counting_forwards(mixtral.model) as calls, pytest.raises(NoEffectError, match="not dispatched"):
        counterfactual(mixtral, token_ids=SHORT, interventions=[spec], trace=trace)
    assert calls == []
    with counting_forwards(mixtral.model) as calls, pytest.raises(NoEffectError, match="not dispatched"):
        counterfactual(mixtral, token_ids=SHORT, interventions=[spec])  # no trace: after the first forward
    assert len(calls) == 1
    _no_hooks_left(mixtral)
    # a dispatched expert, or one token that does use it: runs
    used = int(routing.experts[1, 0])
    assert no_effect_reason(trace, [DisableExpert(expert=used, layer=routing.layer)]) is None
    assert no_effect_reason(trace, [DisableExpert(expert=used, layer=routing.layer, positions=1)]) is None
    assert no_effect_reason(trace, [NextBest(layer=routing.layer, positions=0)]) is None


def test_disabling_for_one_token_that_does_not_use_the_expert_is_refused(mixtral):
    trace = moeviz.capture(mixtral, token_ids=[IDS])
    routing = trace.layers[1]
    other = next(e for e in range(routing.num_experts) if e not in routing.experts[4])
    spec = DisableExpert(expert=other, layer=routing.layer, positions=4)
    assert torch.equal(_logprobs(mixtral, IDS, [spec]), _logprobs(mixtral, IDS))
    assert "not dispatched by the token at position 4" in no_effect_reason(trace, [spec])


def test_forcing_the_expert_already_in_that_slot_is_refused_and_another_is_not(mixtral):
    trace = moeviz.capture(mixtral, token_ids=[IDS])
    routing = trace.layers[0]
    top, second = int(routing.experts[3, 0]), int(routing.experts[3, 1])
    same = ForceExpert(expert=top, layer=routing.layer, positions=3)
    assert torch.equal(_logprobs(mixtral, IDS, [same]), _logprobs(mixtral, IDS))
    assert "already sends its rank-0 slot to expert" in no_effect_reason(trace, [same])
    with pytest.raises(NoEffectError):
        counterfactual(mixtral, token_ids=IDS, interventions=[same], trace=trace)
    swapped = ForceExpert(expert=second, layer=routing.layer, positions=3)  # the two slots swap experts
    assert no_effect_reason(trace, [swapped]) is None
    assert not torch.equal(_logprobs(mixtral, IDS, [swapped]), _logprobs(mixtral, IDS))
    # one no-op among others that act: the set runs
    assert no_effect_reason(trace, [same, swapped]) is None


# ---- subsets --------------------------------------------------------------------------------------------
def test_importance_subsets_match_the_full_sweep_and_skip_undispatched_experts(mixtral):
    full = expert_importance(mixtral, token_ids=SHORT, batch_size=3)
    layer = mixtral.sites[1].layer
    trace = moeviz.capture(mixtral, token_ids=[SHORT])
    routing = trace.layer(layer)
    unused = sorted(set(range(routing.num_experts)) - set(routing.experts.ravel().tolist()))
    chosen = [unused[0], int(routing.experts[0, 0]), int(routing.experts[2, 1])]
    part = expert_importance(mixtral, token_ids=SHORT, layers=[layer], experts=chosen)
    assert part.layer.tolist() == [layer] * len(dict.fromkeys(chosen))
    assert part.expert.tolist() == list(dict.fromkeys(chosen))
    want = full.set_index(["layer", "expert"]).loc[[(layer, e) for e in part.expert]]
    np.testing.assert_allclose(part.delta_loss, want.delta_loss, atol=1e-5)
    skipped = part[part.expert == unused[0]].iloc[0]
    assert not skipped.measured and skipped.delta_loss == 0.0
    # the single-run Δ loss of a measured expert, computed apart
    e = int(routing.experts[0, 0])
    lp = _logprobs(mixtral, SHORT, [DisableExpert(expert=e, layer=layer)])[0]
    loss = float(-lp[:-1].gather(1, torch.tensor(SHORT[1:])[:, None]).mean())
    assert loss == pytest.approx(float(part[part.expert == e].loss.iloc[0]), abs=1e-4)
    # {layer: experts} picks per layer
    per_layer = expert_importance(mixtral, token_ids=SHORT, experts={layer: [e]})
    assert per_layer[["layer", "expert"]].values.tolist() == [[layer, e]]


def test_importance_subset_errors_are_one_clear_line(mixtral):
    moe = sorted({s.layer for s in mixtral.sites})
    with pytest.raises(InputError) as error:
        expert_importance(mixtral, token_ids=IDS, layers=[99])
    assert str(error.value) == f"no MoE layer [99] (MoE layers: {moe})"
    with pytest.raises(InputError, match=r"experts \[8\] out of range: layer \d+ has experts 0\.\.7"):
        expert_importance(mixtral, token_ids=IDS, experts=[1, 8])
    with pytest.raises(InputError, match="no expert chosen"):
        expert_importance(mixtral, token_ids=IDS, experts=[])
    with pytest.raises(InputError, match="not among the chosen"):
        expert_importance(mixtral, token_ids=IDS, layers=[moe[0]], experts={moe[-1]: [0]})
    with pytest.raises(InputError, match="batch_size"):
        expert_importance(mixtral, token_ids=IDS, batch_size=0)


def test_busiest_experts_are_the_most_used_ones(mixtral):
    trace = moeviz.capture(mixtral, token_ids=[IDS])
    busiest = busiest_experts(trace, 3)
    for routing in trace.layers:
        counts = {e: int((routing.experts == e).any(axis=1).sum()) for e in range(routing.num_experts)}
        order = sorted((e for e in counts if counts[e]), key=lambda e: (-counts[e], e))
        assert busiest[routing.layer] == order[:3]
