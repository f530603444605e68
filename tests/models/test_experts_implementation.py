"""The experts implementation a model loads with (`load_model(..., experts_implementation=...)`):
transformers' grouped and batched kernels capture the routing its per-expert loop does, the hooks still see
the experts module's arguments under them, an unusable value is refused in one line; and the numpy slot sort
the decode uses at scale orders slots exactly as the torch decoder does."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.integrations import moe

import moeviz
from moeviz.capture.forward import _slot_keys, sort_slots_np
from moeviz.errors import LoadOptionError
from moeviz.models.decoding import sort_slots

# the tiny DeepSeek-V3 widened towards the real one's routing: top-8 of 64 experts within 4 of 8 groups
FAMILIES = {
    "deepseek_v3": dict(
        n_routed_experts=64, num_experts_per_tok=8, n_group=8, topk_group=4, num_hidden_layers=5
    ),
    "qwen3_moe": {},
    "mixtral": {},
}
SEQS = [list(range(3, 40)), [7, 9, 11, 13, 17, 19]]


def _ulps(a: np.ndarray, b: np.ndarray) -> int:
    """The largest distance between a and b in units of the last place of the larger of the two (fp32)."""
    spacing = np.spacing(np.maximum(np.abs(a), np.abs(b)).astype(np.float32))
    return int(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)) / spacing))


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the calls of transformers' grouped_mm and batched_mm experts kernels (the forwards really ran
    them, not the loop)."""
    calls = {"grouped_mm": 0, "batched_mm": 0}
    for name in calls:
        kernel = moe.ALL_EXPERTS_FUNCTIONS._global_mapping[name]

        def counting(*args, _kernel=kernel, _name=name, **kwargs):
            calls[_name] += 1
            return _kernel(*args, **kwargs)

        monkeypatch.setitem(moe.ALL_EXPERTS_FUNCTIONS._global_mapping, name, counting)
    return calls


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_kernels_capture_the_routing_of_the_per_expert_loop(family, tiny_model_dir, kernel_calls):
    folder = tiny_model_dir(family, **FAMILIES[family])
    eager = moeviz.load_model(folder, experts_implementation="eager")
    assert eager.experts_implementation == "eager"
    reference = moeviz.capture(eager, token_ids=SEQS)
    assert kernel_calls == {"grouped_mm": 0, "batched_mm": 0}
    for name in ("grouped_mm", "batched_mm"):
        loaded = moeviz.load_model(folder, experts_implementation=name)
        assert loaded.experts_implementation == name
        trace = moeviz.capture(loaded, token_ids=SEQS)
        assert kernel_calls[name] == len(loaded.sites)  # one kernel call per MoE layer: not the loop
        assert len(trace.layers) == len(reference.layers) == len(eager.sites)
        for got, want in zip(trace.layers, reference.layers, strict=True):
            assert got.decision_source == want.decision_source == "dispatch"  # from the experts' arguments
            np.testing.assert_array_equal(got.token_rows, want.token_rows)
            np.testing.assert_array_equal(got.experts, want.experts)
            assert _ulps(got.weights, want.weights) <= 64, (name, got.layer)
            np.testing.assert_allclose(got.logits, want.logits, rtol=0, atol=1e-5)


def test_auto_is_what_transformers_picks_and_captures_as_grouped_mm(tiny_model_dir, kernel_calls):
    folder = tiny_model_dir("deepseek_v3", **FAMILIES["deepseek_v3"])
    auto, grouped = moeviz.load_model(folder), moeviz.load_model(folder, experts_implementation="grouped_mm")
    assert auto.experts_implementation == "grouped_mm"
    a, b = moeviz.capture(auto, token_ids=SEQS), moeviz.capture(grouped, token_ids=SEQS)
    assert kernel_calls["grouped_mm"] == 2 * len(auto.sites)
    for x, y in zip(a.layers, b.layers, strict=True):  # the same kernel: the same bits
        np.testing.assert_array_equal(x.experts, y.experts)
        np.testing.assert_array_equal(x.weights, y.weights)


def test_an_unknown_experts_implementation_is_refused_in_one_line(tiny_model_dir):
    with pytest.raises(LoadOptionError) as info:
        moeviz.load_model(tiny_model_dir("mixtral"), experts_implementation="grouped")
    message = str(info.value)
    assert "\n" not in message
    assert "'grouped'" in message and "'eager'" in message and "'grouped_mm'" in message


def test_a_kernel_is_refused_for_experts_that_have_only_the_loop(tiny_model_dir):
    folder = tiny_model_dir("jetmoe")
    with pytest.raises(LoadOptionError) as info:
        moeviz.load_model(folder, experts_implementation="grouped_mm")
    assert "\n" not in str(info.value) and "'jetmoe'" in str(info.value)
    assert moeviz.load_model(folder, experts_implementation="eager").experts_implementation == "eager"


# ---- the slot sort of the decode ------------------------------------------------------------------------
def _torch_sorted(experts: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    flat_e, flat_w = experts.reshape(-1, experts.shape[-1]), weights.reshape(-1, weights.shape[-1])
    e, w = sort_slots(torch.from_numpy(flat_e.astype(np.int64)), torch.from_numpy(flat_w))
    return e.numpy().reshape(experts.shape), w.numpy().reshape(weights.shape)


@pytest.mark.parametrize(
    "case",
    ["scale", "ties", "negative zero", "negative", "nan", "inf", "large ids", "below -1", "int32"],
)
def test_the_slot_sort_orders_as_the_torch_decoder_does(case):
    """The layers × tokens × k slots of a capture, sorted at once, in every case the packed integer key
    covers and every one it leaves to the lexicographic sort: the same experts and weight bits as
    `moeviz.models.decoding.sort_slots`, row by row."""
    rng = np.random.default_rng(0)
    experts = np.stack([rng.permutation(256)[:8] for _ in range(6 * 300)]).reshape(6, 300, 8)
    weights = rng.random((6, 300, 8), dtype=np.float32)
    if case == "ties":  # equal weights (ties by expert id), zeros and dropped slots
        weights = rng.choice(np.float32([0.0, 1e-38, 0.25, 0.5]), size=weights.shape)
        experts[..., -2:] = np.where(rng.random((6, 300, 2)) < 0.5, -1, experts[..., -2:])
    elif case == "negative zero":
        weights[..., ::3] = np.float32(0.0)
        weights[..., 1::3] = np.float32(-0.0)
    elif case == "negative":
        weights -= np.float32(0.5)
    elif case in ("nan", "inf"):
        weights[0, :5, 2] = np.nan if case == "nan" else np.inf
    elif case == "large ids":
        experts[..., 0] += 1 << 24
    elif case == "below -1":
        experts[..., -1] = -2
    elif case == "int32":
        experts = experts.astype(np.int32)
    packed = case in ("scale", "ties", "int32")  # the packed key's cases; the others take the lexsort
    assert (_slot_keys(experts, weights) is not None) == packed
    want_e, want_w = _torch_sorted(experts, weights)
    got_e, got_w = sort_slots_np(experts, weights)
    assert got_e.dtype == experts.dtype and got_w.dtype == np.float32
    np.testing.assert_array_equal(got_e, want_e)
    assert np.array_equal(got_w.view(np.int32), want_w.view(np.int32))  # bits: -0.0 stays -0.0, NaN NaN
