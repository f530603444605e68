"""The quantisation what-if and the prefetch recall against the straightforward references of
tests/support/whatif_reference.py (a deep copy with the weights quantised in place, plain forwards for the
log-probabilities, per-token sets; per-token top-k of the next router), on the bundled sample and on a
group-limited tiny DeepSeek-V3: identical routing comparisons and log-probabilities, and one forward of
each model per sequence routed alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeviz.samples import eval_dir
from moeviz.whatif.prefetch import prefetch_recall
from moeviz.whatif.quant import module_twin, quantisation_flips, quantised_copy
from tests.support import whatif_reference as ref

TEXT = (eval_dir() / "python.txt").read_text(encoding="utf-8")[:300]


@pytest.fixture(scope="module")
def deepseek(tiny_model_dir):
    import moeviz

    return moeviz.load_model(tiny_model_dir("deepseek_v3"))


def _batches(loaded) -> list[list[list[int]]]:
    ids = list(loaded.tokenizer(TEXT)["input_ids"]) if loaded.tokenizer is not None else list(range(3, 90))
    return [
        [ids],
        [ids[:40], ids[40:], ids[5:6]],
    ]  # one sequence alone; several with padding and a 1-token one


@pytest.mark.parametrize("model", ["sample_model", "deepseek"])
@pytest.mark.parametrize("dtype,target", [("int4", "router"), ("int8", "experts"), ("fp8", "both")])
def test_quantisation_matches_the_reference(request, model, dtype, target) -> None:
    loaded = request.getfixturevalue(model)
    state = {k: v.clone() for k, v in loaded.model.state_dict().items()}
    for batch in _batches(loaded):
        result = quantisation_flips(loaded, token_ids=batch, dtype=dtype, target=target)
        want = ref.quantisation(loaded, batch, dtype, target)
        got = result.layers_frame()[["layer", "site", "flip_rate", "top1_agreement", "tokens"]]
        assert got.to_dict("records") == want["layers"]
        flips = result.flips_frame()
        for (layer, site), rows in want["flipped"].items():
            mine = flips[(flips.layer == layer) & (flips.site == site)]["row"] if len(flips) else []
            assert sorted(mine) == rows
        assert result.delta_logprob == want["delta_logprob"]
    assert all(torch.equal(state[k], v) for k, v in loaded.model.state_dict().items())


def test_a_sequence_routed_alone_runs_each_model_once(sample_model) -> None:
    """The log-probabilities of a sequence routed alone come from its capture's own forward."""
    forwards = []
    handle = sample_model.model.register_forward_hook(lambda *_: forwards.append(1))
    try:
        quantisation_flips(sample_model, text=TEXT, dtype="int8", target="router")
    finally:
        handle.remove()
    assert len(forwards) == 1  # the original model's: its capture (the copy's are its own)


def test_the_twin_shares_untouched_tensors_and_carries_no_hooks(sample_model) -> None:
    model = sample_model.model
    handle = model.model.layers[0].register_forward_hook(lambda *_: None)
    try:
        quantised, targets = quantised_copy(sample_model, "int8", "router")
    finally:
        handle.remove()
    twin = quantised.model
    targeted = {t.name for t in targets}
    originals = dict(model.named_parameters())
    for name, param in twin.named_parameters():
        assert (param is originals[name]) == (name not in targeted), name
    assert not any(m._forward_hooks for m in twin.modules())
    assert not {id(m) for m in twin.modules()} & {id(m) for m in model.modules()}
    # a buffer set on the copy stays on the copy
    module_twin(model, {}).register_buffer("extra", torch.zeros(1))
    assert not hasattr(model, "extra")


@pytest.mark.parametrize("model", ["sample_model", "deepseek"])
def test_prefetch_recall_matches_the_reference(request, model) -> None:
    loaded = request.getfixturevalue(model)
    for batch in _batches(loaded):
        frame = prefetch_recall(loaded, token_ids=batch)
        want = ref.prefetch(loaded, batch)
        assert sorted(zip(frame.layer, frame.from_layer, strict=True)) == sorted(want)
        for row in frame.itertuples():
            recall, tokens = want[(row.layer, row.from_layer)]
            assert row.tokens == tokens
            np.testing.assert_allclose(row.recall, recall, rtol=1e-12)
