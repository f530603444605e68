"""Capture mechanics: padding, generate, hooks lifecycle, loud failure, generic discovery, lengths."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import moeviz
from moeviz.errors import CaptureError, InputError, PromptTooLongError
from moeviz.models.sites import find_moe_sites


def _hook_count(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def _rows_of(trace, seq):
    """Per layer: experts [n, k] and weights [n, k] of sequence `seq`, ordered by position."""
    out = []
    for routing in trace.layers:
        tok = trace.tokens.iloc[routing.token_rows]
        mine = np.nonzero(tok["seq"].to_numpy() == seq)[0]
        order = mine[np.argsort(tok["pos"].to_numpy()[mine])]
        out.append((routing.experts[order], routing.weights[order], routing.logits[order]))
    return out


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3", "switch_transformers"])
def test_padding_is_masked_and_does_not_change_routing(tiny_model_dir, family):
    loaded = moeviz.load_model(tiny_model_dir(family))
    short, long = [5, 6, 7], [10, 11, 12, 13, 14, 15, 16]
    batch = moeviz.capture(loaded, token_ids=[long, short])
    alone = moeviz.capture(loaded, token_ids=[short])
    assert len(batch.tokens[batch.tokens.stream == "input"]) == len(long) + len(short)
    for (be, bw, bl), (ae, aw, al) in zip(_rows_of(batch, 1), _rows_of(alone, 0), strict=True):
        np.testing.assert_allclose(bl, al, atol=1e-5)
        if family != "switch_transformers":  # capacity is shared by the whole batch, so drops may differ
            assert (be == ae).all()
            np.testing.assert_allclose(bw, aw, atol=1e-6)


def test_generate_marks_prompt_and_steps(tiny_model_dir):
    loaded = moeviz.load_model(tiny_model_dir("mixtral"))
    prompt = [5, 6, 7, 8]
    plain = moeviz.capture(loaded, token_ids=[prompt])
    gen = moeviz.capture(loaded, token_ids=[prompt], generate=4)
    with torch.no_grad():
        expected = loaded.model.generate(
            torch.tensor([prompt]), max_new_tokens=4, do_sample=False, pad_token_id=0
        )
    tokens = gen.tokens
    assert tokens.token_id.tolist() == expected[0].tolist()
    assert tokens.phase.tolist() == ["prompt"] * 4 + ["generated"] * (len(tokens) - 4)
    # The prompt's routing in generate (prefill) equals a plain forward's.
    for g, p in zip(gen.layers, plain.layers, strict=True):
        prompt_rows = g.token_rows < 4
        assert (g.experts[prompt_rows] == p.experts).all()
        np.testing.assert_allclose(g.logits[prompt_rows], p.logits, atol=1e-5)
        # Each generated token except the last one was fed back and routed once, in its own step.
        routed = tokens.iloc[g.token_rows]
        assert routed[routed.phase == "generated"].step.tolist() == list(range(1, len(tokens) - 4))


def test_progress_counts_router_calls(tiny_model_dir):
    loaded = moeviz.load_model(tiny_model_dir("mixtral"))
    sites = len(loaded.sites)
    seen = []
    moeviz.capture(loaded, token_ids=[[5, 6, 7]], progress=lambda done, total: seen.append((done, total)))
    assert seen == [(i, sites) for i in range(1, sites + 1)]
    seen.clear()
    gen = moeviz.capture(loaded, token_ids=[[5, 6, 7]], generate=3, progress=lambda d, t: seen.append((d, t)))
    forwards = int(gen.tokens.step.max())  # the prefill and each step that fed a token back (not the last)
    assert [d for d, _ in seen] == list(range(1, sites * forwards + 1))
    assert {t for _, t in seen} == {sites * 3}


def test_one_forward_builds_no_kv_cache_and_routes_as_with_one(tiny_model_dir):
    """A single forward is captured with use_cache=False (its KV cache would never be read); the routing
    equals that of the model's default forward (with a cache), recorded by a hook of this test."""
    loaded = moeviz.load_model(tiny_model_dir("mixtral"))
    seen: list[object] = []
    handle = loaded.model.register_forward_pre_hook(
        lambda _m, _a, kwargs: seen.append(kwargs.get("use_cache", "default")), with_kwargs=True
    )
    try:
        trace = moeviz.capture(loaded, token_ids=[[5, 6, 7, 8]])
    finally:
        handle.remove()
    assert seen == [False]
    logits = []
    router = loaded.sites[0].router.register_forward_hook(lambda _m, _a, out: logits.append(out[0]))
    try:
        with torch.inference_mode():
            loaded.model(input_ids=torch.tensor([[5, 6, 7, 8]]))  # use_cache defaults to True here
    finally:
        router.remove()
    np.testing.assert_array_equal(trace.layers[0].logits, logits[0].reshape(4, -1).numpy())

    from moeviz.capture.forward import _without_cache

    class NoCacheArgument(torch.nn.Module):  # e.g. remote code: its forward is called as it is
        def forward(self, input_ids, attention_mask=None):
            return input_ids

    assert _without_cache(NoCacheArgument) == {}


def test_generate_routing_equals_forward_on_full_sequence(tiny_model_dir):
    """The step-by-step (KV-cached) routing equals one forward over prompt + generated tokens."""
    loaded = moeviz.load_model(tiny_model_dir("qwen3_moe"))
    gen = moeviz.capture(loaded, token_ids=[[5, 6, 7]], generate=5)
    full = moeviz.capture(loaded, token_ids=[gen.tokens.token_id.tolist()[:-1]])
    for g, f in zip(gen.layers, full.layers, strict=True):
        assert (g.experts == f.experts).all()
        np.testing.assert_allclose(g.weights, f.weights, atol=1e-5)


def test_batched_generate_with_left_padding(tiny_model_dir):
    loaded = moeviz.load_model(tiny_model_dir("olmoe"))
    gen = moeviz.capture(loaded, token_ids=[[5, 6, 7, 8, 9], [10, 11]], generate=3)
    alone = moeviz.capture(loaded, token_ids=[[10, 11]], generate=3)
    short = gen.tokens[gen.tokens.seq == 1]
    assert short.pos.tolist() == list(range(len(short)))
    assert short.token_id.tolist() == alone.tokens.token_id.tolist()
    for (be, _, bl), (ae, _, al) in zip(_rows_of(gen, 1), _rows_of(alone, 0), strict=True):
        assert (be == ae).all()
        np.testing.assert_allclose(bl, al, atol=1e-4)


def test_hooks_are_removed_after_capture_and_after_errors(tiny_model_dir):
    loaded = moeviz.load_model(tiny_model_dir("mixtral"))
    before = _hook_count(loaded.model)
    moeviz.capture(loaded, token_ids=[5, 6, 7])
    assert _hook_count(loaded.model) == before

    def explode(*args, **kwargs):
        raise RuntimeError("boom inside the forward")

    layer = loaded.model.model.layers[1]
    original = layer.forward
    layer.forward = explode
    try:
        with pytest.raises(RuntimeError, match="boom"):
            moeviz.capture(loaded, token_ids=[5, 6, 7])
    finally:
        layer.forward = original
    assert _hook_count(loaded.model) == before


def test_hooks_that_did_not_fire_fail_loudly(tiny_model_dir):
    """A replaced forward that calls the router's .forward directly bypasses hooks: say so."""
    loaded = moeviz.load_model(tiny_model_dir("mixtral"))
    block = loaded.model.model.layers[0].mlp
    original = block.forward

    def kernel_forward(hidden_states):
        flat = hidden_states.view(-1, hidden_states.shape[-1])
        _, weights, index = block.gate.forward(flat)
        return block.experts.forward(flat, index, weights).view_as(hidden_states)

    block.forward = kernel_forward
    try:
        with pytest.raises(CaptureError, match="did not fire"):
            moeviz.capture(loaded, token_ids=[5, 6, 7])
    finally:
        block.forward = original


def _hide_recorder_table(model, monkeypatch):
    """Make `model` look like remote code: no router table, and a model type outside the family table."""
    for cls in {c for m in model.modules() for c in type(m).__mro__}:
        if "_can_record_outputs" in vars(cls):
            monkeypatch.setattr(cls, "_can_record_outputs", {})
    monkeypatch.setattr(model.config, "model_type", f"remote_{model.config.model_type}")


def test_generic_discovery_without_recorder_table(tiny_model_dir, monkeypatch):
    """Models without `_can_record_outputs` (remote code) are found structurally and decoded exactly."""
    loaded = moeviz.load_model(tiny_model_dir("mixtral"))
    reference = moeviz.capture(loaded, token_ids=[[5, 6, 7, 8]])
    _hide_recorder_table(loaded.model, monkeypatch)
    sites = find_moe_sites(loaded.model)
    assert [s.decoder for s in sites] == ["auto", "auto"]
    loaded.sites = sites
    generic = moeviz.capture(loaded, token_ids=[[5, 6, 7, 8]])
    for g, r in zip(generic.layers, reference.layers, strict=True):
        assert g.decision_source == "dispatch" and g.score_fn == "softmax"
        assert (g.experts == r.experts).all()
        np.testing.assert_array_equal(g.weights, r.weights)


def test_generic_discovery_infers_sigmoid_scores(tiny_model_dir, monkeypatch):
    loaded = moeviz.load_model(tiny_model_dir("deepseek_v3"))
    _hide_recorder_table(loaded.model, monkeypatch)
    loaded.sites = find_moe_sites(loaded.model)
    trace = moeviz.capture(loaded, token_ids=[[5, 6, 7, 8, 9, 10]])
    assert {layer.score_fn for layer in trace.layers} == {"sigmoid"}
    assert all(layer.bias is not None for layer in trace.layers)


def test_prompt_too_long(tiny_model_dir):
    loaded = moeviz.load_model(tiny_model_dir("mixtral"))
    with pytest.raises(PromptTooLongError, match="context length of 512"):
        moeviz.capture(loaded, token_ids=[[5] * 513])
    with pytest.raises(PromptTooLongError):
        moeviz.capture(loaded, token_ids=[[5] * 510], generate=3)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"token_ids": []}, "empty"),
        ({"token_ids": [[5], []]}, "empty"),
        ({"token_ids": [5, 999]}, "out of range"),
        ({"texts": "hello"}, "no tokenizer"),
        ({}, "exactly one"),
    ],
)
def test_bad_input(tiny_model_dir, kwargs, message):
    loaded = moeviz.load_model(tiny_model_dir("mixtral"))
    with pytest.raises(InputError, match=message):
        moeviz.capture(loaded, **kwargs)


def test_text_capture_uses_tokenizer(sample_model):
    text = "def add(a, b): return a + b"
    trace = moeviz.capture(sample_model, text)
    assert trace.tokens.token_id.tolist() == sample_model.tokenizer(text)["input_ids"]
    assert "".join(trace.tokens.token) == text


def test_predicted_next_token_is_the_models_argmax(tiny_model_dir):
    loaded = moeviz.load_model(tiny_model_dir("olmoe"))
    seqs = [[5, 6, 7, 8, 9], [10, 11, 12]]
    trace = moeviz.capture(loaded, token_ids=seqs)
    for b, seq in enumerate(seqs):
        with torch.no_grad():
            expected = loaded.model(input_ids=torch.tensor([seq])).logits[0].argmax(-1).tolist()
        assert trace.tokens[trace.tokens.seq == b].predicted_id.tolist() == expected
    gen = moeviz.capture(loaded, token_ids=[[5, 6, 7]], generate=3)
    ids, predicted = gen.tokens.token_id.tolist(), gen.tokens.predicted_id.tolist()
    assert predicted[:2] == [-1, -1]  # generate computes no next-token logits for earlier prompt positions
    assert predicted[2:-1] == ids[3:]


def test_numpy_slot_sort_matches_the_torch_decoder():
    """Capture decodes `experts(hidden, top_k_index, top_k_weights)` in numpy: the same slots, in the same
    order, as `moeviz.models.decoding.sort_slots` (dropped last, ties by expert id), sorted or not."""
    from moeviz.capture.forward import sort_slots_np
    from moeviz.models.decoding import sort_slots

    rng = np.random.default_rng(0)
    for k in (1, 2, 4):
        experts = rng.integers(-1, 8, size=(200, k))
        # ties, and weights a packed float key could not tell apart (1e-30 vs 2e-30 under a 1e-9 id term)
        levels = np.float32([0.0, 1e-30, 2e-30, 0.25, 0.5, 0.75])
        weights = rng.choice(levels, size=(200, k)).astype(np.float32)
        want = sort_slots(torch.from_numpy(experts), torch.from_numpy(weights))
        got = sort_slots_np(experts, weights)
        np.testing.assert_array_equal(got[0], want[0].numpy())
        np.testing.assert_array_equal(got[1], want[1].numpy())
        for row_e, row_w in zip(got[0], got[1], strict=True):  # the order itself, by a plain Python sort
            slots = sorted(zip(row_e, row_w, strict=True), key=lambda s: (s[0] < 0, -s[1], s[0]))
            assert [e for e, _ in slots] == row_e.tolist()
        ordered = sort_slots_np(*got)  # already in order: returned as it is
        np.testing.assert_array_equal(ordered[0], got[0])


def test_an_unread_token_table_does_not_keep_the_model_alive(tiny_model_dir):
    import gc
    import weakref

    loaded = moeviz.load_model(tiny_model_dir("mixtral"))
    model = weakref.ref(loaded.model)
    expected = loaded.token_texts([5, 6, 5])
    trace = moeviz.capture(loaded, token_ids=[[5, 6, 5]])
    del loaded
    gc.collect()
    assert model() is None  # the lazy table holds the tokenizer and its cache, not the model ...
    assert trace.tokens["token"].tolist() == expected  # ... and still decodes the strings


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_an_unobservable_dispatch_is_recomputed_only_by_the_models_own_rule(
    tiny_model_dir, monkeypatch, family
):
    """A remote-code router whose dispatch cannot be seen (no experts hook, no index/weights in its output):
    a softmax router without a bias is recomputed (and marked so); a sigmoid router with a balancing bias
    is refused, not recomputed as softmax top-k."""
    import importlib

    forward = importlib.import_module("moeviz.capture.forward")  # `moeviz.capture` is also the function

    loaded = moeviz.load_model(tiny_model_dir(family))
    _hide_recorder_table(loaded.model, monkeypatch)
    loaded.sites = find_moe_sites(loaded.model)
    for site in loaded.sites:
        site.experts = None

    def unreadable(*_):
        raise ValueError("router output carries no (index, weights) pair")

    monkeypatch.setattr(forward, "from_router_tuple", unreadable)
    if family == "mixtral":
        trace = moeviz.capture(loaded, token_ids=[[5, 6, 7, 8]])
        assert {r.decision_source for r in trace.layers} == {"recomputed"}
        assert any("recomputed as softmax top-2" in note for note in trace.model.notes)
    else:
        with pytest.raises(CaptureError, match="does not recompute routing by a rule the model lacks"):
            moeviz.capture(loaded, token_ids=[[5, 6, 7, 8]])
