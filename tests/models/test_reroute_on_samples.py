"""Re-routing the samples' captured router logits (`moeviz.analysis.reroute`): the captured settings
reproduce the model's routing, every number is moeviz.analysis's on the re-routed layer, and the forced
re-run is `counterfactual(ForceRouting(...))`. The hand-computed 3 × 4 cases are in
tests/unit/test_reroute.py."""

from __future__ import annotations

import numpy as np
import pytest

import moeviz
from moeviz.analysis import expert_balance_frame, loss_frame, loss_stats
from moeviz.analysis.losses import aux_loss_dispatched, router_probs
from moeviz.analysis.reroute import RerouteSettings, max_k, reroute_layer
from moeviz.interventions import ForceRouting, counterfactual
from tests.support.traces import dense_weights, expert_sets

TEXT = "The quick brown fox jumps over the lazy dog, and then it runs back home to sleep."


@pytest.fixture(scope="module")
def mixtral():
    loaded = moeviz.load_model("sample:mixtral-healthy")
    return loaded, moeviz.capture(loaded, TEXT)


@pytest.fixture(scope="module")
def deepseek():
    loaded = moeviz.load_model("sample:deepseek-v3-bias")
    return loaded, moeviz.capture(loaded, TEXT)


def _assert_reproduces(trace: moeviz.Trace) -> None:
    losses = loss_frame(trace).set_index(["site", "layer"])
    for routing in trace.layers:
        settings = RerouteSettings.captured(routing)
        assert (settings.k, settings.score_fn, settings.temperature) == (routing.k, routing.score_fn, 1.0)
        r = reroute_layer(trace, routing.layer, settings, routing.site)
        assert expert_sets(r.experts) == expert_sets(routing.experts) and r.changed_tokens == 0
        np.testing.assert_allclose(
            dense_weights(r.experts, r.weights, routing.num_experts),
            dense_weights(routing.experts, routing.weights, routing.num_experts),
            rtol=1e-5,
            atol=1e-6,
        )
        # every number is moeviz.analysis's, on the re-routed layer and on the captured one
        layer = r.as_layer_routing()
        assert r.aux_loss_dispatched == loss_stats(layer).aux_loss_dispatched
        assert r.captured_aux_loss_dispatched == losses.loc[routing.key, "aux_loss_dispatched"]
        assert r.aux_loss_dispatched == pytest.approx(r.captured_aux_loss_dispatched, rel=1e-5)
        assert r.per_expert_aux_terms["term"].sum() == pytest.approx(r.aux_loss_dispatched, rel=1e-9)
        counts = expert_balance_frame(r.as_trace(trace))["count"].to_numpy()
        assert r.load.tolist() == counts.tolist() == r.captured_load.tolist()


def test_captured_settings_reproduce_mixtral(mixtral) -> None:
    _, trace = mixtral
    assert RerouteSettings.captured(trace.layers[0]).bias is None
    _assert_reproduces(trace)


def test_captured_settings_reproduce_deepseek_v3_with_bias_and_group_limit(deepseek) -> None:
    _, trace = deepseek
    routing = trace.layers[0]
    settings = RerouteSettings.captured(routing)
    assert settings.score_fn == "sigmoid" and settings.bias is not None and settings.renormalise
    assert reroute_layer(trace, routing.layer, settings, routing.site).groups == (4, 2)
    assert max_k(routing) == 8 and max_k(routing, group_limit=False) == 16
    _assert_reproduces(trace)


def test_aux_loss_after_a_change_is_the_analysis_loss(mixtral) -> None:
    _, trace = mixtral
    routing = trace.layers[1]
    r = reroute_layer(trace, routing.layer, RerouteSettings(k=3, temperature=2.0, capacity_factor=0.5))
    layer = r.as_layer_routing()
    assert (
        r.aux_loss_dispatched
        == aux_loss_dispatched(router_probs(layer), layer.experts)
        == loss_stats(layer).aux_loss_dispatched
    )
    assert r.dropped_slots == int((layer.experts < 0).sum()) > 0
    assert r.load.sum() + r.dropped_slots == 3 * len(routing.token_rows)


def test_the_forced_rerun_is_the_counterfactual(mixtral) -> None:
    loaded, trace = mixtral
    routing = trace.layers[1]
    ids = [int(i) for i in trace.tokens["token_id"]]
    # the captured routing forced back changes nothing
    same = reroute_layer(trace, routing.layer, RerouteSettings.captured(routing))
    cf = counterfactual(
        loaded, token_ids=ids, interventions=[ForceRouting(routing.layer, *same.forced(), site=routing.site)]
    )
    np.testing.assert_allclose(cf.logprob_after, cf.logprob_before, atol=1e-5)
    # top-1: the experts receive exactly the re-routed decision
    r = reroute_layer(trace, routing.layer, RerouteSettings(k=1))
    assert r.changed_tokens == len(routing.token_rows)
    cf = counterfactual(
        loaded, token_ids=ids, interventions=[ForceRouting(routing.layer, *r.forced(), site=routing.site)]
    )
    after = cf.after.layer(routing.layer, routing.site)
    live = np.where(after.weights != 0, after.experts, -1)
    assert expert_sets(live) == expert_sets(r.experts)
    np.testing.assert_allclose(after.weights.max(axis=1), 1.0, rtol=1e-6)
    assert np.abs(cf.logprob_after - cf.logprob_before).max() > 1e-4


def test_capacity_drops_are_the_capacity_replays(mixtral) -> None:
    """The playground's capacity and `whatif capacity`'s probs policy rank an over-full expert's slots by
    one implementation (`moeviz.scoring.capacity_ranks`): re-routing at CF drops per expert exactly what the
    replay of the uncapped re-routing drops at that CF."""
    from moeviz.whatif.capacity import replay_capacity
    from moeviz.whatif.routes import routes_from_trace

    _, trace = mixtral
    routing = trace.layers[1]
    uncapped = reroute_layer(trace, routing.layer, RerouteSettings(k=2))
    routes = routes_from_trace(uncapped.as_trace(trace))
    for cf in (0.5, 0.8, 1.0):
        capped = reroute_layer(trace, routing.layer, RerouteSettings(k=2, capacity_factor=cf))
        replayed = replay_capacity(routes, [cf], policy="probs").experts_frame()
        dropped = uncapped.load - capped.load
        np.testing.assert_array_equal(replayed["dropped"].to_numpy(), dropped)
        assert capped.dropped_slots == int(replayed["dropped"].sum()) > 0
