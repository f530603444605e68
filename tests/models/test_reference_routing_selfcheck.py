"""Self-check of the reference routing oracle (`tests/support/reference_routing.py`) against what each tiny
model did.

The model's decision is read with temporary hooks placed here, independently of the oracle:
- a forward pre-hook on each MoE block's `experts` module, whose arguments are the dispatch
  (hidden [N, H], top_k_index [N, k], top_k_weights [N, k]); Switch passes a one-hot [N, 1, E] mask
  (all-zero row = dropped by capacity) and probs [N, 1]; NLLB a [N, E] mask and [N, E] combine weights;
- for llama4 and jetmoe, whose experts do not receive the routing, a forward hook on the router output.
Raw logits are also checked against `output_router_logits=True`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from moeviz.testing.tiny_models import SEQ2SEQ, VOCAB, build_tiny_model

try:  # works both with and without a tests/__init__.py
    from tests.support.reference_routing import RULE_FAMILIES, RefRouting, canonical_order, reference_routing
except ImportError:  # pragma: no cover
    from reference_routing import RefRouting, canonical_order, reference_routing

Key = tuple[str, int]
Decision = tuple[np.ndarray, np.ndarray]  # experts [N, k] int64, weights [N, k] float32

BATCH, SEQ = 2, 9
WEIGHT_ATOL = 1e-6
LOGIT_ATOL = 1e-5
ROUTER_OUTPUT_FAMILIES = {"llama4_text", "jetmoe"}  # their experts never see the routing
BIASED_FAMILIES = ("deepseek_v3", "glm4_moe", "kimi_linear", "ernie4_5_moe")
# transformers' output_router_logits, which this check reads, leaves out DeepSeek-V4's hash layers and has one
# entry per looped block, not per pass: their oracle is checked against the experts modules' own arguments
# through moeviz's capture (test_capture_families, test_every_family)
SELF_CHECKED = tuple(f for f in RULE_FAMILIES if f not in ("deepseek_v4", "inkling2_loop_text"))


# ----------------------------------------------------------------------------------------------------
# Inputs and model-side capture
# ----------------------------------------------------------------------------------------------------


def build(family: str, seed: int = 0, **overrides: Any) -> nn.Module:
    """build_tiny_model plus a workaround: tiny_models.randomise_routing only walks named_parameters(), so
    the e_score_correction_bias *buffers* of deepseek_v3 / glm4_moe / kimi_linear stay all-zero and the bias
    path would go untested. Randomise any all-zero bias buffer here (a no-op once tiny_models is fixed)."""
    model = build_tiny_model(family, seed=seed, **overrides)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias") and not torch.count_nonzero(buf):
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.5)
    return model


def make_inputs(family: str, seed: int = 0, attention_mask: torch.Tensor | None = None) -> dict[str, Any]:
    """2 × 9 random token ids in [3, VOCAB) (plus decoder ids for seq2seq)."""
    gen = torch.Generator().manual_seed(seed)
    kwargs: dict[str, Any] = {"input_ids": torch.randint(3, VOCAB, (BATCH, SEQ), generator=gen)}
    if family in SEQ2SEQ:
        kwargs["decoder_input_ids"] = torch.randint(3, VOCAB, (BATCH, SEQ), generator=gen)
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    return kwargs


def site_layer(name: str) -> Key:
    """(site, layer) from a module's qualified name, independently of the oracle's tree walk."""
    m = re.search(r"(encoder|decoder)\.(?:block|layers)\.(\d+)\.", name)
    if m:
        return m.group(1), int(m.group(2))
    m = re.search(r"(?:layers|blocks)\.(\d+)\.(self_attention\.)?", name)
    assert m, name
    return ("attention" if m.group(2) else "mlp"), int(m.group(1))


def _decode_experts_args(family: str, args: list[Any]) -> Decision:
    """Decode the dispatch the MoE block handed to its `experts` module."""
    if family == "switch_transformers":
        mask, probs = args[1].reshape(args[1].shape[0], -1), args[2].reshape(-1)  # [N, E], [N]
        kept = mask.sum(-1) > 0
        experts = torch.where(kept, mask.argmax(-1), -1)
        weights = torch.where(kept, probs.float(), 0.0)
        return experts[:, None].numpy(), weights[:, None].numpy()
    if family == "nllb-moe":
        combine = args[2].float()  # [N, E]; the experts used are its non-zero entries
        n_tok = combine.shape[0]
        experts = np.full((n_tok, 2), -1, dtype=np.int64)
        weights = np.zeros((n_tok, 2), dtype=np.float32)
        for t in range(n_tok):
            used = torch.nonzero(combine[t]).flatten().tolist()
            assert len(used) <= 2, used
            experts[t, : len(used)] = used
            weights[t, : len(used)] = combine[t, used].numpy()
        return experts, weights
    return args[1].long().numpy(), args[2].float().numpy()


def _decode_router_output(family: str, output: Any, k: int) -> Decision:
    """llama4: (scores [N, E]: sigmoid on the chosen k, 0 elsewhere; logits).
    jetmoe: (index_sorted_experts, batch_index, batch_gates, expert_size, logits), grouped by expert."""
    if family == "llama4_text":
        scores = output[0].float()
        experts = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
        assert bool((scores > 0).sum(-1).eq(k).all()), "llama4 router should score exactly k experts"
        return experts.numpy(), scores.gather(1, experts).numpy()
    index_sorted, _batch_index, gates, expert_size, logits = output
    n_tok = logits.shape[0]
    experts = np.full((n_tok * k,), -1, dtype=np.int64)
    weights = np.zeros((n_tok * k,), dtype=np.float32)
    owner = np.repeat(np.arange(len(expert_size)), expert_size)  # expert of each sorted slot
    experts[index_sorted.numpy()] = owner
    weights[index_sorted.numpy()] = gates.float().numpy()
    return experts.reshape(n_tok, k), weights.reshape(n_tok, k)


def model_routing(
    model: nn.Module, family: str, k: int, **forward_kwargs: Any
) -> tuple[dict[Key, Decision], list[Key]]:
    """What the model itself dispatched, per (site, layer), and the order the routers ran in."""
    decisions: dict[Key, list[Decision]] = {}
    order: list[Key] = []
    handles = []

    def experts_hook(key: Key) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            decisions.setdefault(key, []).append(
                _decode_experts_args(family, list(args) + list(kwargs.values()))
            )

        return hook

    def router_hook(key: Key) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            order.append(key)
            if family in ROUTER_OUTPUT_FAMILIES:
                decisions.setdefault(key, []).append(_decode_router_output(family, output, k))

        return hook

    try:
        for name, module in model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            # jetmoe's MoE/MoA blocks hold `input_linear`/`output_linear` instead of an `experts` module
            is_router = leaf in ("gate", "router") and (hasattr(parent, "experts") or family == "jetmoe")
            if is_router:
                handles.append(module.register_forward_hook(router_hook(site_layer(name))))
            if (
                leaf == "experts"
                and family not in ROUTER_OUTPUT_FAMILIES
                and (hasattr(parent, "gate") or hasattr(parent, "router"))
            ):
                handles.append(
                    module.register_forward_pre_hook(experts_hook(site_layer(name)), with_kwargs=True)
                )
        with torch.no_grad():
            model(**forward_kwargs)
    finally:
        for handle in handles:
            handle.remove()
    for key, calls in decisions.items():
        assert len(calls) == 1, f"{key} dispatched {len(calls)} times"
    return {key: canonical_order(*calls[0]) for key, calls in decisions.items()}, order


def top_k_of(config: Any, family: str) -> int:
    if family == "dbrx":
        return config.ffn_config.moe_top_k
    if family in ("switch_transformers",):
        return 1
    if family in ("nllb-moe", "phimoe"):
        return 2
    return config.num_experts_per_tok


def router_logits_output(model: nn.Module, family: str, **forward_kwargs: Any) -> list[torch.Tensor]:
    """Raw logits the model reports with output_router_logits=True, in call order, each [N, E]."""
    with torch.no_grad():
        out = model(**forward_kwargs, output_router_logits=True)
    if family in SEQ2SEQ:
        groups = [out.encoder_router_logits, out.decoder_router_logits]
    else:
        groups = [out.router_logits]
    flat: list[torch.Tensor] = []
    for group in groups:
        for item in group or ():
            t = item[0] if isinstance(item, tuple) else item
            flat.append(t.reshape(-1, t.shape[-1]).float())
    return flat


# ----------------------------------------------------------------------------------------------------
# Comparison
# ----------------------------------------------------------------------------------------------------


def assert_matches(ref: dict[Key, RefRouting], got: dict[Key, Decision], label: str) -> None:
    assert set(ref) == set(got), f"{label}: oracle keys {sorted(ref)} != model keys {sorted(got)}"
    for key in sorted(ref):
        r, (g_exp, g_w) = ref[key], got[key]
        assert r.experts.shape == g_exp.shape, f"{label} {key}: shape {r.experts.shape} vs {g_exp.shape}"
        as_sets = np.sort(r.experts, -1) == np.sort(g_exp, -1)
        bad = np.flatnonzero(~as_sets.all(-1))
        assert bad.size == 0, (
            f"{label} {key}: expert sets differ on tokens {bad.tolist()}: "
            f"oracle {r.experts[bad].tolist()} model {g_exp[bad].tolist()}"
        )
        np.testing.assert_array_equal(r.experts, g_exp, err_msg=f"{label} {key}: slot order")
        np.testing.assert_allclose(
            r.weights, g_w, rtol=0, atol=WEIGHT_ATOL, err_msg=f"{label} {key}: weights"
        )


def check_family(family: str, seed: int = 0, attention_mask: torch.Tensor | None = None, **overrides: Any):
    """Build, route with the oracle and the model, compare. Returns (oracle result, model result)."""
    model = build(family, seed=seed, **overrides)
    inputs = make_inputs(family, seed=seed, attention_mask=attention_mask)
    ref = reference_routing(model, family, **inputs)
    got, order = model_routing(model, family, top_k_of(model.config, family), **inputs)
    assert_matches(ref, got, family)

    logits = router_logits_output(model, family, **inputs)
    assert len(logits) == len(order), f"{family}: {len(logits)} router logits for {len(order)} router calls"
    for key, reported in zip(order, logits, strict=True):
        np.testing.assert_allclose(
            ref[key].logits, reported.numpy(), rtol=0, atol=LOGIT_ATOL, err_msg=f"{family} {key}: logits"
        )
    return model, ref, got


# ----------------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", SELF_CHECKED)
def test_oracle_matches_model(family: str) -> None:
    _, ref, _ = check_family(family)
    for key, r in ref.items():
        n_tok = BATCH * SEQ
        assert r.logits.shape[0] == n_tok and r.experts.shape[0] == n_tok and r.weights.shape[0] == n_tok
        assert r.logits.dtype == np.float32 and r.weights.dtype == np.float32 and r.experts.dtype == np.int64
        # non-degenerate routing: several experts in use, and not every token routed identically
        used = np.unique(r.experts[r.experts >= 0])
        assert used.size >= 2, f"{family} {key}: degenerate routing, experts used {used.tolist()}"
        distinct = {tuple(row) for row in r.experts.tolist()}
        assert len(distinct) >= 2, f"{family} {key}: all tokens routed alike"


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss", "dbrx", "jetmoe"])
def test_oracle_matches_with_padding(family: str) -> None:
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[0, :3] = 0  # left padding: routers still see padded positions
    check_family(family, attention_mask=mask)


CONFIG_VARIANTS: list[tuple[str, dict[str, Any]]] = [
    ("mixtral", dict(num_experts_per_tok=3)),
    ("hunyuan_v1_moe", dict(moe_topk=[3, 1])),  # per-layer top-k
    ("olmoe", dict(norm_topk_prob=True)),
    ("jamba", dict(num_experts_per_tok=3)),
    ("deepseek_v3", dict(norm_topk_prob=False)),
    ("glm4_moe", dict(n_group=4, topk_group=2, num_experts_per_tok=3)),
    ("kimi_linear", dict(moe_renormalize=False)),
    ("ernie4_5_moe", dict(moe_norm_min=0.9)),  # the sum clamp binds for most tokens
    ("gpt_oss", dict(num_experts_per_tok=4)),
    ("granitemoe", dict(num_experts_per_tok=1)),
    ("llama4_text", dict(num_experts_per_tok=2)),
    ("jetmoe", dict(num_experts_per_tok=1)),
    ("switch_transformers", dict(router_bias=True, expert_capacity=3)),
    ("nllb-moe", dict(router_bias=True, moe_eval_capacity_token_fraction=0.3)),
]


@pytest.mark.parametrize(("family", "overrides"), CONFIG_VARIANTS, ids=[f for f, _ in CONFIG_VARIANTS])
def test_config_variants(family: str, overrides: dict[str, Any]) -> None:
    check_family(family, **overrides)


def test_ernie_norm_min_clamp_binds() -> None:
    _, ref, _ = check_family("ernie4_5_moe", moe_norm_min=0.9)
    sums = np.concatenate([r.weights.sum(-1) for r in ref.values()])
    assert np.any(sums < 0.99), "moe_norm_min=0.9 should leave some weight sums below 1"


def test_switch_capacity_drops_tokens() -> None:
    _, ref, _ = check_family("switch_transformers", expert_capacity=2)
    dropped = sum(int((r.experts == -1).sum()) for r in ref.values())
    assert dropped > 0, "expert_capacity=2 over 9-token sequences should drop at least one token"
    for r in ref.values():
        assert np.all(r.weights[r.experts == -1] == 0)


def test_switch_capacity_is_per_sequence() -> None:
    """The same capacity budget restarts for every sequence: no expert exceeds it in any one sequence."""
    _, ref, _ = check_family("switch_transformers", expert_capacity=2)
    for r in ref.values():
        per_seq = r.experts[:, 0].reshape(BATCH, SEQ)
        for row in per_seq:
            counts = np.bincount(row[row >= 0], minlength=4)
            assert counts.max() <= 2
    # and more than `capacity` tokens were kept per expert over the whole batch somewhere
    kept_total = [np.bincount(r.experts[r.experts >= 0]).max() for r in ref.values()]
    assert max(kept_total) > 2


@pytest.mark.parametrize(
    "overrides",
    [
        dict(moe_eval_capacity_token_fraction=0.25),
        dict(moe_eval_capacity_token_fraction=0.25, batch_prioritized_routing=True),
        dict(moe_eval_capacity_token_fraction=0.25, normalize_router_prob_before_dropping=True),
        dict(
            moe_eval_capacity_token_fraction=0.25,
            batch_prioritized_routing=True,
            normalize_router_prob_before_dropping=True,
        ),
        dict(moe_eval_capacity_token_fraction=-1.0, expert_capacity=3),
    ],
    ids=["frac", "frac-bpr", "frac-norm-before", "frac-bpr-norm-before", "fixed-capacity"],
)
def test_nllb_capacity_variants(overrides: dict[str, Any]) -> None:
    _, ref, _ = check_family("nllb-moe", **overrides)
    dropped = sum(int((r.experts == -1).sum()) for r in ref.values())
    assert dropped > 0, f"{overrides}: expected capacity drops"


def test_nllb_padding() -> None:
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, -4:] = 0
    _, ref, _ = check_family("nllb-moe", attention_mask=mask)
    # eager encoder: padded positions (additive mask < 0) route nowhere
    enc = [r for key, r in ref.items() if key[0] == "encoder"]
    for r in enc:
        padded = r.experts.reshape(BATCH, SEQ, 2)[1, -4:]
        assert np.all(padded == -1)


def test_deepseek_v2_greedy() -> None:
    check_family("deepseek_v2", topk_method="greedy")


@pytest.mark.parametrize("overrides", [{}, dict(topk_group=2, num_experts_per_tok=3)])
def test_deepseek_v2_group_limit_is_exercised(overrides: dict[str, Any]) -> None:
    """v2 scores a group by its max prob, so the group limit only binds when k > topk_group (the tiny
    default has k=2, topk_group=1)."""
    _, ref, _ = check_family("deepseek_v2", **overrides)
    changed = 0
    for r in ref.values():
        probs = torch.softmax(torch.from_numpy(r.logits), -1)
        changed += _count_changed(torch.topk(probs, r.experts.shape[1]).indices, r.experts)
    assert changed > 0, f"{overrides}: group limit never changed a decision"


@pytest.mark.parametrize("eps", [0.0, 0.01, 0.3])
def test_phimoe_jitter_eps(eps: float) -> None:
    _, ref, _ = check_family("phimoe", router_jitter_noise=eps)
    sums = np.concatenate([r.weights.sum(-1) for r in ref.values()])
    if eps == 0.0:
        np.testing.assert_allclose(sums, 2.0, atol=1e-6)  # each mask keeps only its own max
    else:
        assert np.any(np.abs(sums - 1.0) > 1e-3), "sparsemixer weights should not be renormalised"


def _bias(model: nn.Module, family: str, key: Key) -> torch.Tensor:
    """The selection-only bias of the router at `key`, [E]."""
    gate = model.get_submodule(f"model.layers.{key[1]}.mlp.gate")
    if family == "ernie4_5_moe":
        return gate.moe_statics.e_score_correction_bias.detach().reshape(-1)
    return gate.e_score_correction_bias.detach()


def _score(family: str, logits: np.ndarray) -> torch.Tensor:
    t = torch.from_numpy(logits)
    return torch.softmax(t, -1) if family == "ernie4_5_moe" else torch.sigmoid(t)


def _count_changed(a: torch.Tensor, experts: np.ndarray) -> int:
    """Tokens whose expert set in `a` [N, k] differs from `experts` [N, k]."""
    return int((a.sort(-1).values.numpy() != np.sort(experts, -1)).any(-1).sum())


def _selection(family: str, config: Any, scores: torch.Tensor, k: int) -> torch.Tensor:
    """The family's selection on `scores` [N, E] (group-limited for the sigmoid families) -> [N, k]."""
    if family == "ernie4_5_moe":
        return torch.topk(scores, k).indices
    n_group, topk_group = config.n_group, config.topk_group
    grouped = scores.view(scores.shape[0], n_group, -1)
    best = torch.topk(grouped.topk(2, dim=-1).values.sum(-1), topk_group).indices  # [N, topk_group]
    allowed = torch.zeros(scores.shape[0], n_group, dtype=torch.bool).scatter_(1, best, True)
    masked = scores.masked_fill(~allowed.repeat_interleave(grouped.shape[-1], 1), float("-inf"))
    return torch.topk(masked, k).indices


@pytest.mark.parametrize("family", BIASED_FAMILIES)
def test_bias_changes_decisions(family: str) -> None:
    """Same rule with the bias zeroed must pick differently somewhere, i.e. the bias path is exercised."""
    model, ref, _ = check_family(family)
    changed = 0
    for key, r in ref.items():
        assert torch.count_nonzero(_bias(model, family, key)), f"{family} {key}: bias is all zero"
        unbiased = _selection(family, model.config, _score(family, r.logits), r.experts.shape[1])
        changed += _count_changed(unbiased, r.experts)
    assert changed > 0, f"{family}: e_score_correction_bias never changed a decision"


def test_deepseek_v3_group_limit_is_exercised() -> None:
    model, ref, _ = check_family("deepseek_v3", n_group=4, topk_group=2)
    changed = 0
    for key, r in ref.items():
        biased = _score("deepseek_v3", r.logits) + _bias(model, "deepseek_v3", key)
        plain = torch.topk(biased, r.experts.shape[1]).indices
        changed += _count_changed(plain, r.experts)
    assert changed > 0, "n_group=4/topk_group=2 never changed a decision vs plain top-k on biased scores"


@pytest.mark.parametrize("family", ["glm4_moe", "kimi_linear"])
def test_group_limit_glm_kimi(family: str) -> None:
    """glm4 (n_group=2, topk_group=1) and kimi (num_expert_group=2): the group path is live too."""
    model, ref, _ = check_family(family)
    changed = 0
    for key, r in ref.items():
        biased = _score(family, r.logits) + _bias(model, family, key)
        changed += _count_changed(torch.topk(biased, r.experts.shape[1]).indices, r.experts)
    assert changed > 0


def test_qwen_norm_topk_prob_variants() -> None:
    _, ref, _ = check_family("qwen2_moe", norm_topk_prob=True)
    for r in ref.values():
        np.testing.assert_allclose(r.weights.sum(-1), 1.0, atol=1e-6)
    _, ref, _ = check_family("qwen3_moe", norm_topk_prob=False)
    for r in ref.values():
        assert np.all(r.weights.sum(-1) < 1.0)


@pytest.mark.parametrize("p", [None, 2.0])
def test_dbrx_normalisation(p: float | None) -> None:
    ffn = {"ffn_hidden_size": 32, "moe_num_experts": 8, "moe_top_k": 2, "moe_normalize_expert_weights": p}
    _, ref, _ = check_family("dbrx", ffn_config=ffn)
    norms = np.concatenate([np.linalg.norm(r.weights, ord=p or 1, axis=-1) for r in ref.values()])
    if p == 2.0:
        np.testing.assert_allclose(norms, 1.0, atol=1e-6)
    else:
        assert np.all(norms < 1.0)


def test_hooks_are_removed() -> None:
    model = build("mixtral")
    before = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    reference_routing(model, "mixtral", **make_inputs("mixtral"))
    after = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    assert before == after


def test_training_mode_rejected() -> None:
    model = build("mixtral").train()
    with pytest.raises(ValueError):
        reference_routing(model, "mixtral", **make_inputs("mixtral"))
