"""Re-routing router logits (`moeviz.analysis.reroute`) on a hand-computed 3 × 4 case: the captured settings,
temperature, bias, capacity and the forced arrays. On the samples' captures:
tests/models/test_reroute_on_samples.py."""

from __future__ import annotations

import numpy as np
import pytest

from moeviz.analysis import loss_stats
from moeviz.analysis.reroute import RerouteSettings, reroute
from moeviz.errors import InputError
from moeviz.trace import LayerRouting
from tests.support.traces import dense_weights, expert_sets, routed_layer

P = np.array(
    [
        [0.40, 0.30, 0.20, 0.10],
        [0.10, 0.20, 0.30, 0.40],
        [0.35, 0.05, 0.40, 0.20],
    ]
)


def _layer(probs: np.ndarray = P, k: int = 2) -> LayerRouting:
    """A softmax layer whose scores are `probs` (logits = log p), routed top-k renormalised."""
    return routed_layer(np.log(probs), k)


# ---- hand-computed: 3 tokens × 4 experts ----------------------------------------------------------------
def test_captured_settings_and_the_hand_computed_aux_loss() -> None:
    layer = _layer()
    settings = RerouteSettings.captured(layer)
    assert (settings.k, settings.score_fn, settings.renormalise, settings.scale) == (2, "softmax", True, 1.0)
    r = reroute(layer, settings)
    assert (
        expert_sets(r.experts) == [{0, 1}, {2, 3}, {0, 2}] and r.changed_tokens == 0 and r.dropped_slots == 0
    )
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
    assert expert_sets(r.experts) == [{0, 3}, {2, 3}, {2, 3}]
    dense = dense_weights(r.experts, r.weights, 4)
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
