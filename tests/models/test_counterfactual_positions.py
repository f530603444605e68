"""The counterfactual's per-position effect (`Counterfactual.position_frame`): Δ log-prob of the prompt's
actual next token at every position, against plain forwards of the bundled sample model."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import moeviz
from moeviz.interventions import DisableExpert, counterfactual, intervening

MODEL = "sample:mixtral-healthy"
TEXT = "The quick brown fox jumps over the lazy dog, and then it runs back home to sleep."
POS = 4  # the intervened token


@pytest.fixture(scope="module")
def loaded():
    return moeviz.load_model(MODEL)


@pytest.fixture(scope="module")
def ids(loaded):
    return [int(i) for i in moeviz.capture(loaded, TEXT).tokens["token_id"]]


def _actual_next_logprobs(model, ids: list[int]) -> np.ndarray:
    """log p(x_{t+1} | x_≤t) for t < T-1 of one plain forward: log_softmax gathered at the next ids."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)[:-1]
    return logprobs.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()


def _top1(loaded, ids: list[int], layer: int, pos: int) -> int:
    routing = moeviz.capture(loaded, token_ids=[ids]).layer(layer)
    row = list(routing.token_rows).index(pos)
    return int(routing.experts[row][np.argmax(routing.weights[row])])


@pytest.mark.parametrize("site", [0, -1], ids=["first-moe-layer", "last-moe-layer"])
def test_per_position_deltas_match_two_plain_forwards(loaded, ids, site):
    layer = loaded.sites[site].layer
    spec = DisableExpert(expert=_top1(loaded, ids, layer, POS), layer=layer, positions=POS)
    result = counterfactual(loaded, token_ids=ids, interventions=[spec])
    frame = result.position_frame()

    before = _actual_next_logprobs(loaded.model, ids)
    with intervening(loaded, [spec], len(ids)):
        after = _actual_next_logprobs(loaded.model, ids)
    want = after - before

    columns = ["pos", "token", "next_token", "logprob_before", "logprob_after", "delta", "routing_changed"]
    assert set(columns) <= set(frame.columns)
    assert frame["pos"].tolist() == list(range(len(ids) - 1))
    np.testing.assert_allclose(frame["logprob_before"], before, atol=1e-5)
    np.testing.assert_allclose(frame["delta"], want, atol=1e-5)
    earlier = frame["delta"].to_numpy()[:POS]
    if site == -1:  # causal: the predictions before the intervened token are untouched, exactly
        assert (earlier == 0).all()
    else:  # the same, up to float regrouping: the intervened token's changed routing at later layers
        assert np.abs(earlier).max() < 1e-5  # changes the experts' batch shapes, hence GEMM rounding
    assert np.abs(want[POS:]).max() > 1e-4  # the intervention does reach the later predictions
    assert frame["intervened"].tolist() == [p == POS for p in frame["pos"]]
    assert result.first_intervened == POS
    assert result.mean_delta_after == pytest.approx(float(want[POS:].mean()), abs=1e-6)
    assert result.max_abs_delta_after == pytest.approx(float(np.abs(want[POS:]).max()), abs=1e-6)
    # routing: the intervened token's experts changed at that layer; nothing before it changed anywhere
    changed = frame.set_index("pos")["routing_changed"]
    assert changed[POS] and not changed[:POS].any()


def test_disabling_an_expert_everywhere_matches_a_copy_with_its_weights_zeroed(loaded, ids):
    layer = loaded.sites[1].layer
    expert = _top1(loaded, ids, layer, POS)
    result = counterfactual(loaded, token_ids=ids, interventions=[DisableExpert(expert=expert, layer=layer)])
    frame = result.position_frame()

    model = copy.deepcopy(loaded.model)
    with torch.no_grad():  # the expert's output projection zeroed by hand: it contributes nothing
        model.model.layers[layer].mlp.experts.down_proj[expert].zero_()
    want = _actual_next_logprobs(model, ids) - _actual_next_logprobs(loaded.model, ids)

    np.testing.assert_allclose(frame["delta"], want, atol=1e-4)
    assert result.intervened_positions is None and result.first_intervened == 0
    assert frame["intervened"].all() and frame["after"].all()
    assert result.mean_delta_after == pytest.approx(float(want.mean()), abs=1e-5)
