"""Re-routing captured router logits (`moeviz.analysis.reroute`): the captured settings reproduce the model's
routing on the samples, every number is moeviz.analysis's on the re-routed layer, a hand-computed 3 × 4 case
for temperature, bias and capacity, and the forced re-run is `counterfactual(ForceRouting(...))`."""

from __future__ import annotations

import numpy as np
import pytest

import moeviz
from moeviz.analysis import expert_balance_frame, loss_frame, loss_stats
from moeviz.analysis.losses import aux_loss_dispatched, router_probs
from moeviz.analysis.reroute import RerouteSettings, max_k, reroute, reroute_layer
from moeviz.errors import InputError
from moeviz.interventions import ForceRouting, counterfactual
from moeviz.scoring import scores_from_logits
from moeviz.trace import LayerRouting

TEXT = "The quick brown fox jumps over the lazy dog, and then it runs back home to sleep."
P = np.array(
    [
        [0.40, 0.30, 0.20, 0.10],
        [0.10, 0.20, 0.30, 0.40],
        [0.35, 0.05, 0.40, 0.20],
    ]
)


def _dense(experts: np.ndarray, weights: np.ndarray, num_experts: int) -> np.ndarray:
    """[N, E] weight per (token, expert); dispatched experts only."""
    out = np.zeros((len(experts), num_experts))
    rows, slots = np.nonzero(experts >= 0)
    out[rows, experts[rows, slots]] = weights[rows, slots]
    return out


def _sets(experts: np.ndarray) -> list[set[int]]:
    return [{int(e) for e in row if e >= 0} for row in experts]


def _layer(probs: np.ndarray = P, k: int = 2) -> LayerRouting:
    """A softmax layer whose scores are `probs` (logits = log p), routed top-k renormalised."""
    logits = np.log(probs).astype(np.float32)
    scores = scores_from_logits(logits, "softmax")
    experts = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    weights = np.take_along_axis(scores, experts, axis=1)
    weights = weights / weights.sum(axis=1, keepdims=True)
    return LayerRouting(
        layer=0,
        site="mlp",
        token_rows=np.arange(len(probs)),
        logits=logits,
        experts=experts,
        weights=weights.astype(np.float32),
        score_fn="softmax",
    )


# ---- hand-computed: 3 tokens × 4 experts ----------------------------------------------------------------
def test_captured_settings_and_the_hand_computed_aux_loss() -> None:
    layer = _layer()
    settings = RerouteSettings.captured(layer)
    assert (settings.k, settings.score_fn, settings.renormalise, settings.scale) == (2, "softmax", True, 1.0)
    r = reroute(layer, settings)
    assert _sets(r.experts) == [{0, 1}, {2, 3}, {0, 2}] and r.changed_tokens == 0 and r.dropped_slots == 0
    np.testing.assert_allclose(
        r.weights, [[4 / 7, 3 / 7], [4 / 7, 3 / 7], [0.4 / 0.75, 0.35 / 0.75]], rtol=1e-6
    )
    assert r.experts[1].tolist() == [3, 2]  # slots by weight, largest first
    # f = [2, 1, 2, 1] / 3, P = column means of p: E·Σ f P = 4·(2·.85 + .55 + 2·.9 + .7)/9 = 19/9
    assert r.aux_loss_dispatched == pytest.approx(19 / 9, rel=1e-6)
    terms = r.per_expert_aux_terms
    np.testing.assert_allclose(terms["f"], [2 / 3, 1 / 3, 2 / 3, 1 / 3])
    np.testing.assert_allclose(terms["P"], [0.85 / 3, 0.55 / 3, 0.9 / 3, 0.7 / 3], rtol=1e-6)
    assert terms["term"].sum() == pytest.approx(r.aux_loss_dispatched, rel=1e-9)
    assert r.load.tolist() == [2, 1, 2, 1]


def test_temperature_sharpens_the_scores() -> None:
    r = reroute(_layer(), RerouteSettings(k=2, temperature=0.5))
    squared = P**2 / (P**2).sum(axis=1, keepdims=True)  # softmax(log p / ½) = p² / Σ p²
    np.testing.assert_allclose(r.scores, squared, rtol=1e-5)
    np.testing.assert_allclose(r.weights[0], [0.16 / 0.25, 0.09 / 0.25], rtol=1e-5)
    np.testing.assert_allclose(r.as_layer_routing().logits, 2 * np.log(P), rtol=1e-5)
    assert r.changed_tokens == 0  # a monotone change keeps every top-k set


def test_bias_moves_the_choice_but_not_the_weights() -> None:
    bias = np.array([0.0, 0.0, 0.0, 0.25])
    r = reroute(_layer(), RerouteSettings(k=2, bias=bias))
    # selection: [.4 .3 .2 .35], [.1 .2 .3 .65], [.35 .05 .4 .45]
    assert _sets(r.experts) == [{0, 3}, {2, 3}, {2, 3}]
    dense = _dense(r.experts, r.weights, 4)
    np.testing.assert_allclose(dense[0], [0.8, 0, 0, 0.2], rtol=1e-6)  # weights from the unbiased scores
    np.testing.assert_allclose(dense[2], [0, 0, 2 / 3, 1 / 3], rtol=1e-6)
    assert r.changed.tolist() == [True, False, True] and r.changed_tokens == 2
    np.testing.assert_allclose(r.selection_scores, P + bias, rtol=1e-6)


def test_capacity_drops_the_smallest_weights_per_sequence() -> None:
    layer = _layer()
    # T = 3, k = 2, E = 4, CF = 0.5: C = ceil(1.5 · 0.5) = 1
    r = reroute(layer, RerouteSettings(k=2, capacity_factor=0.5))
    assert r.capacity == 1 and r.dropped_slots == 2
    assert r.experts.tolist() == [
        [0, 1],
        [3, -1],
        [2, -1],
    ]  # expert 0 keeps .571 > .467, expert 2 .533 > .429
    np.testing.assert_allclose(r.weights[1:, 1], 0.0)
    assert r.load.tolist() == [1, 1, 1, 1] and r.changed_tokens == 2
    assert loss_stats(r.as_layer_routing()).aux_loss_dispatched == pytest.approx(r.aux_loss_dispatched)
    # two sequences (tokens 0–1 and 2): C = 1 in each, and no expert is over-full within one
    r = reroute(layer, RerouteSettings(k=2, capacity_factor=0.5), seqs=np.array([0, 0, 1]))
    assert r.dropped_slots == 0


def test_capacity_ties_keep_the_earlier_token() -> None:
    probs = np.array([[0.4, 0.3, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.4, 0.3]])
    r = reroute(_layer(probs), RerouteSettings(k=1, capacity_factor=1.0))  # weights all 1, C = 1
    assert r.experts[:, 0].tolist() == [0, -1, 2]


def test_sigmoid_without_renormalising_and_the_forced_arrays() -> None:
    layer = _layer()
    r = reroute(layer, RerouteSettings(k=1, score_fn="sigmoid", renormalise=False))
    logits = np.log(P)
    np.testing.assert_allclose(r.weights[:, 0], 1 / (1 + np.exp(-logits.max(axis=1))), rtol=1e-6)
    experts, weights = r.forced()  # padded to the captured 2 slots
    assert experts[:, 1].tolist() == [-1, -1, -1] and weights[:, 1].tolist() == [0, 0, 0]
    with pytest.raises(InputError, match="choose k ≤ 2"):
        reroute(layer, RerouteSettings(k=3)).forced()


def test_bad_settings_say_what_to_change() -> None:
    layer = _layer()
    for settings, message in (
        (RerouteSettings(k=5), "choose 1 to 4"),
        (RerouteSettings(k=2, temperature=0.0), "temperature"),
        (RerouteSettings(k=2, score_fn="relu"), "score function"),
        (RerouteSettings(k=2, bias=np.zeros(3)), "bias"),
        (RerouteSettings(k=2, capacity_factor=-1.0), "capacity factor"),
    ):
        with pytest.raises(InputError, match=message):
            reroute(layer, settings)


# ---- the sample models ----------------------------------------------------------------------------------
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
        assert _sets(r.experts) == _sets(routing.experts) and r.changed_tokens == 0
        np.testing.assert_allclose(
            _dense(r.experts, r.weights, routing.num_experts),
            _dense(routing.experts, routing.weights, routing.num_experts),
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
    assert _sets(live) == _sets(r.experts)
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
