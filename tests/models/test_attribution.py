"""Router and next-token attribution (captum): completeness, a constructed router, the perturbation check."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import moeviz
from moeviz.attribution import TokenAttribution, next_token_attribution, router_attribution
from moeviz.errors import InputError

IDS = [5, 17, 33, 9, 60, 21, 44, 8]


@pytest.fixture(scope="module")
def mixtral(tiny_model_dir):
    return moeviz.load_model(tiny_model_dir("mixtral"))


def test_ig_completeness_and_value_is_the_captured_router_score(mixtral):
    layer, pos = mixtral.sites[0].layer, 6
    trace = moeviz.capture(mixtral, token_ids=[IDS])
    routing = trace.layer(layer)
    expert = int(routing.experts[pos, 0])
    result = router_attribution(mixtral, token_ids=IDS, position=pos, layer=layer, expert=expert, n_steps=64)
    assert result.ig.shape == (pos + 1,)
    assert result.value == pytest.approx(float(routing.scores[pos, expert]), abs=1e-5)
    gap = result.ig.sum() - (result.value - result.baseline_value)
    assert abs(gap) <= abs(result.delta) + 1e-5
    assert result.relative_delta < 0.02, result.warnings  # first MoE layer: smooth path, IG converges


def test_a_large_delta_is_reported(mixtral):
    with pytest.warns(UserWarning, match="convergence delta"):
        result = router_attribution(
            mixtral, token_ids=IDS, position=7, layer=1, expert=0, n_steps=2, delta_tolerance=1e-6
        )
    assert result.warnings


@pytest.fixture
def constructed(tiny_model_dir):
    """Tiny Mixtral whose first router's logit for expert 3 is driven by token id 42 alone: layer 0's
    attention is silenced, router row 3 reads direction u, only token 42's embedding has a u component."""
    loaded = moeviz.load_model(tiny_model_dir("mixtral"))
    model = loaded.model
    with torch.no_grad():
        layer0 = model.model.layers[0]
        layer0.self_attn.o_proj.weight.zero_()
        emb = model.get_input_embeddings().weight
        u = torch.zeros(emb.shape[1])
        u[0] = 1.0
        emb[:, 0] = 0.0
        emb[42] = 3.0 * u + 0.1 * emb[42]
        router = loaded.sites[0].router.weight
        router.zero_()
        router[3] = 5.0 * u
    return loaded


def test_constructed_router_gets_its_token_as_top_attribution(constructed):
    ids = [5, 17, 33, 42, 60, 21]
    result = router_attribution(
        constructed, token_ids=ids, position=3, layer=constructed.sites[0].layer, expert=3, target="logit"
    )
    assert result.value > 1.0 and result.baseline_value == pytest.approx(0.0, abs=1e-6)
    assert result.top(1) == [3]
    assert result.top(1, "ablation") == [3]
    others = np.delete(np.arange(4), 3)
    np.testing.assert_allclose(result.ig[others], 0.0, atol=1e-6)
    np.testing.assert_allclose(result.ablation[others], 0.0, atol=1e-6)
    assert result.ig[3] == pytest.approx(result.value - result.baseline_value, abs=abs(result.delta) + 1e-4)


def test_next_token_attribution_ablation_is_captums_llm_api(mixtral):
    result = next_token_attribution(mixtral, token_ids=IDS, position=5)
    assert result.token_ids.tolist() == IDS[:6]
    target = IDS[6]
    with torch.no_grad():

        def logp(ids):
            return float(torch.log_softmax(mixtral.model(torch.tensor([ids])).logits[0, -1], -1)[target])

        pad = mixtral.model.config.pad_token_id
        manual = [logp(IDS[:6]) - logp([*IDS[:i], pad, *IDS[i + 1 : 6]]) for i in range(6)]
    np.testing.assert_allclose(result.ablation, manual, atol=1e-5)
    assert result.value == pytest.approx(logp(IDS[:6]), abs=1e-5)


def test_result_shapes_are_checked_with_readable_messages():
    with pytest.raises(ValueError, match=r"ig: expected shape \[3\]"):
        TokenAttribution("x", np.arange(3), ["a", "b", "c"], np.zeros(4), 0.0, 1.0, 0.0, "pad", 8)
    with pytest.raises(ValueError, match="tokens: expected 3 strings"):
        TokenAttribution("x", np.arange(3), ["a"], np.zeros(3), 0.0, 1.0, 0.0, "pad", 8)


def test_bad_requests_are_clear_errors(mixtral):
    with pytest.raises(InputError, match="position 20 outside"):
        router_attribution(mixtral, token_ids=IDS, position=20, layer=0, expert=0)
    with pytest.raises(InputError, match="no MoE layer 9"):
        router_attribution(mixtral, token_ids=IDS, position=2, layer=9, expert=0)
    with pytest.raises(InputError, match="baseline"):
        router_attribution(mixtral, token_ids=IDS, position=2, layer=0, expert=0, baseline="unk")
