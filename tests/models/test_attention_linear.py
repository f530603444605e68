"""Linear-attention layers: exact attention-like maps reproduce the layer's own attention output."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import moeviz
from moeviz.capture.attention import recording_attention
from moeviz.whatif.kv_cache import kv_cache_whatif

# Right-padded batches. MiniMax block_size is 16 (two blocks: the inter-block state path is exercised);
# Qwen3-Next's and Kimi Linear's kernel chunk is 64 (three chunks for the longest sequence).
CASES = {
    "minimax": ((20, 13), "decay"),
    "qwen3_next": ((150, 70), "delta"),
    "kimi_linear": ((150, 70), "kda"),
}
DELTA_MODULES = ("Qwen3NextGatedDeltaNet", "KimiLinearDeltaAttention")


def _batch(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 120, (n,), generator=gen).tolist() for n in lengths]


def _layer_outputs(model) -> tuple[dict[int, list], list]:
    """Hooks on each linear layer's norm (`norm`, Kimi: `o_norm`): its input is the attention output
    o [B, T, H, Dv] before the norm / gate / output projection."""
    seen: dict[int, list] = {}
    handles = []
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("LightningAttention") or name in DELTA_MODULES:
            heads = (
                getattr(module, "num_attention_heads", None)
                or getattr(module, "num_v_heads", None)
                or module.num_heads
            )
            layer = module.layer_idx

            def pre(_mod, args, layer=layer, heads=heads, owner=module):
                o = args[0]
                if o.dim() == 2:  # Qwen3-Next flattens to [B*T*H, Dv] before its gated norm
                    b, t = owner._shape
                    o = o.reshape(b, t, heads, -1)
                else:
                    o = o.reshape(o.shape[0], o.shape[1], heads, -1)
                seen.setdefault(layer, []).append(o.detach().double().clone())

            def remember_shape(mod, args, kwargs):
                hidden = args[0] if args else kwargs["hidden_states"]
                mod._shape = tuple(hidden.shape[:2])

            handles.append(module.register_forward_pre_hook(remember_shape, with_kwargs=True))
            norm = module.o_norm if hasattr(module, "o_norm") else module.norm
            handles.append(norm.register_forward_pre_hook(pre))
    return seen, handles


@pytest.fixture(scope="module")
def captured(tiny_model_dir):
    cache = {}

    def get(family):
        if family not in cache:
            lengths, _ = CASES[family]
            loaded = moeviz.load_model(tiny_model_dir(family))
            seen, handles = _layer_outputs(loaded.model)
            try:
                trace = moeviz.capture(loaded, token_ids=_batch(lengths), attention=True)
            finally:
                for handle in handles:
                    handle.remove()
            cache[family] = (loaded, trace, seen)
        return cache[family]

    return get


@pytest.mark.parametrize("family", sorted(CASES))
def test_linear_map_reproduces_the_layers_own_output(captured, family):
    _loaded, trace, seen = captured(family)
    att = trace.attention
    lengths, kind = CASES[family]
    assert att.linear_layers and set(att.linear_layers) == set(seen)
    worst = 0.0
    for layer in att.linear_layers:
        assert att.linear[layer].kind == kind
        (own,) = seen[layer]  # one forward
        for seq, n in enumerate(lengths):
            mine = att.linear_output(layer, seq)  # [H, L, Dv] from the map and the recorded values
            theirs = own[seq, :n].permute(1, 0, 2).numpy()
            # Relative to the largest output: tiny random models give outputs far below 1 (Kimi: ~2e-3).
            worst = max(worst, float(np.abs(mine - theirs).max()) / float(np.abs(theirs).max()))
    print(f"{family}: max error {worst:.2e} relative to the largest output")
    assert worst < 1e-5, worst


@pytest.mark.parametrize("family", sorted(CASES))
def test_linear_maps_through_the_common_api(captured, family):
    loaded, trace, _ = captured(family)
    att = trace.attention
    layer = att.linear_layers[0]
    n = int(att.lengths[1])
    full = att.full(layer, 1, 1)
    assert full.shape == (n, n)
    assert np.allclose(np.triu(full, 1), 0.0)  # causal
    assert np.allclose(att.row(layer, 1, 1, 5), full[5])
    assert np.allclose(att.block(layer, 1, 1, rows=[3, 9], cols=slice(2, 8)), full[[3, 9], 2:8])
    assert np.allclose(att.learned_sink_mass(layer, 1, 1), 0.0)
    # Every layer is accounted for exactly once: softmax map, linear map or a reason.
    layers = set(range(loaded.info.num_layers))
    assert set(att.map_layers) | set(att.linear_layers) | set(att.no_map) == layers
    assert not set(att.linear_layers) & (set(att.no_map) | set(att.map_layers))
    grid = att.head_summary()
    linear_rows = grid[grid.kind == "linear"]
    assert set(linear_rows.layer) == set(att.linear_layers)
    assert linear_rows.reason.str.contains("not softmax probabilities").all()
    with pytest.raises(ValueError, match="not a probability"):
        att.summaries(layers=[layer])
    with pytest.raises(ValueError, match="not a probability"):  # the per-token statistics behind them
        att.token_statistics(layer, 8, 0)
    table = att.kv_cache_bytes_per_token().set_index("layer")
    assert table.loc[layer, "kind"] == "linear (state)"
    assert table.loc[layer, "bytes_per_token"] == 0
    assert not kv_cache_whatif(att, 8).layer.isin(att.linear_layers).any()


def test_decay_map_closed_form(captured):
    """MiniMax: A[h, t, j] = (q_t · k_j) · exp(−s_h (t − j)) with the layer's own slopes."""
    loaded, trace, _ = captured("minimax")
    att = trace.attention
    layer = att.linear_layers[0]
    spec = att.linear[layer]
    module = next(
        m
        for m in loaded.model.modules()
        if getattr(m, "layer_idx", None) == layer and hasattr(m, "slope_rate")
    )
    slopes = module.slope_rate.reshape(-1).double().numpy()
    n = int(att.lengths[0])
    q = spec.query[0, 2, :n].astype(np.float64)
    k = spec.key[0, 2, :n].astype(np.float64)
    t = np.arange(n)
    expected = np.tril((q @ k.T) * np.exp(-slopes[2] * (t[:, None] - t[None, :]).clip(min=0)))
    assert np.allclose(att.full(layer, 2, 0), expected, atol=1e-12)


def test_kda_map_entries_match_the_models_recurrent_kernel(captured):
    """Kimi KDA: the map's entries (not only A·V, which [T, Dv] values do not pin down) equal the model's own
    token-by-token kernel run on one-hot values: o_t[j] = A[t, j]."""
    from transformers.models.kimi_linear.modeling_kimi_linear import recurrent_kimi_delta_attention

    _loaded, trace, _ = captured("kimi_linear")
    att = trace.attention
    spec = att.linear[att.linear_layers[0]]
    n = int(att.lengths[1])
    parts = (spec.query, spec.key, spec.log_decay, spec.beta)
    q, k, g, beta = (torch.from_numpy(x[1:2, :, :n]).transpose(1, 2) for x in parts)  # [1, T, H, ...]
    heads, dk = q.shape[2], q.shape[3]
    one_hot = torch.eye(n)[None, :, None, :].expand(1, n, heads, n)
    # The recorded q is already l2-normalised and scaled by Dk^-½; the kernel scales it once more.
    out, _ = recurrent_kimi_delta_attention(q * dk**0.5, k, one_hot, g, beta, None, False)  # [1, T, H, T]
    worst = 0.0
    for head in range(heads):
        expected = out[0, :, head].double().numpy()
        err = np.abs(att.full(spec.layer, head, 1) - expected).max() / np.abs(expected).max()
        worst = max(worst, float(err))
    print(f"kda map entries: max error {worst:.2e} relative to the largest entry")
    assert worst < 1e-5, worst
    assert spec.log_decay.shape == (*spec.key.shape[:3], dk)  # one gate per key channel
    assert np.ptp(spec.log_decay[1, 0, :n], axis=-1).max() > 0.1  # ... and they differ (not a scalar gate)


def test_kimi_linear_layers_all_mapped_jamba_stays_without(tiny_model_dir):
    kimi = moeviz.load_model(tiny_model_dir("kimi_linear"))
    att = moeviz.capture(kimi, token_ids=_batch((10, 7)), attention=True).attention
    assert not att.no_map  # KDA layers are linear, MLA layers softmax
    assert {att.linear[layer].kind for layer in att.linear_layers} == {"kda"} and att.map_layers
    jamba = moeviz.load_model(tiny_model_dir("jamba"))
    att = moeviz.capture(jamba, token_ids=_batch((10, 7)), attention=True).attention
    assert att.no_map and not att.linear_layers
    for layer, why in att.no_map.items():
        assert "Mamba" in why
        with pytest.raises(KeyError, match="no attention map"):
            att.row(layer, 0, 0, 0)


def test_kda_layer_run_twice_has_no_map(tiny_model_dir):
    from moeviz.capture.attention_build import build_attention

    model = moeviz.load_model(tiny_model_dir("kimi_linear")).model
    ids = torch.tensor(_batch((9,)))
    with recording_attention(model) as recorder:
        model(input_ids=ids)
        model(input_ids=ids)
    recorder.calls.clear()  # the softmax layer ran twice too; only the linear layers are under test here
    att = build_attention(model, recorder, 3, np.zeros(1, dtype=np.int64), np.array([9]))
    assert not att.linear_layers
    assert all("ran 2 times" in att.no_map[layer] for layer in (0, 1))


def test_hooks_are_thread_aware_and_always_removed(tiny_model_dir):
    from transformers.models.kimi_linear import modeling_kimi_linear
    from transformers.models.qwen3_next import modeling_qwen3_next

    kernels = (
        modeling_qwen3_next.torch_chunk_gated_delta_rule,
        modeling_kimi_linear.chunk_kimi_delta_attention,
    )
    for family in CASES:
        model = moeviz.load_model(tiny_model_dir(family)).model
        ids = torch.tensor([_batch((12,))[0]])
        with recording_attention(model) as recorder:
            other = threading.Thread(target=lambda: model(input_ids=ids))  # noqa: B023
            other.start()
            other.join()
            assert recorder.linear == []  # another thread's forward is not recorded
            with pytest.raises(RuntimeError, match="boom"), recording_attention(model):
                raise RuntimeError("boom")
            model(input_ids=ids)
            assert recorder.linear  # this thread's forward is
        assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
        assert modeling_qwen3_next.torch_chunk_gated_delta_rule is kernels[0]
        assert modeling_kimi_linear.chunk_kimi_delta_attention is kernels[1]
