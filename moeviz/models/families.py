"""The family table: for every MoE model type transformers ships, how moeviz reads its routing, and what the
README's family table says about it.

One row per `model_type` (a composite's text model type too, since `find_moe_sites` looks that up first):
the score function its router applies to the logits, the decoder that reads the dispatch
(`moeviz.models.decoding.DECODERS`), and what a capture records — `support`:

- "exact": the experts module's own arguments, after every selection rule (bias, groups, scaling, capacity)
- "router output": decoded from what the router returns, by the family's own rule (no experts module gets
  the decision: Llama 4, JetMoE, Doge's product keys)
- "hash table": some layers choose experts by a fixed token-id → experts table (recorded exactly, but the
  scores do not explain the choice)
- "refused": moeviz refuses the model type, with `note` saying why

`note` says what is special. `tests/models/test_every_family.py` checks every row against a tiny model
built from the family's config class; `scripts/family_table.py` writes the README table from this one.
"""

from __future__ import annotations

from dataclasses import dataclass

from moeviz.scoring import BiasOn, ScoreFn

SUPPORT_LEVELS = ("exact", "router output", "hash table", "refused")


@dataclass(frozen=True)
class Family:
    """How moeviz reads one model type's routing. `score_fn` None: read from the config
    (`scoring_func`, `score_func` or `expert_selection_fn`), softmax when it names none."""

    score_fn: ScoreFn | None
    decoder: str = "expert_args"
    support: str = "exact"
    note: str = ""
    # "scores": the balancing bias is added to the scores for selection (DeepSeek-V3 and most);
    # "logits": to the raw logits (Kolibri-1)
    bias_on: BiasOn = "scores"
    # the router's first output holds probabilities, not logits (Gemma 4): logits are recorded as log p
    # (softmax(log p) = p, so the scores are exact)
    outputs_probabilities: bool = False


def _rows(score_fn: ScoreFn | None, *types: str, **fields) -> dict[str, Family]:
    return {t: Family(score_fn, **fields) for t in types}


_DENSE = "dense in transformers 5.24 (no router); listed because it shares code with an MoE family"

_CHECKPOINTS: dict[str, Family] = {
    # softmax routers whose experts module receives the decision
    **_rows(
        "softmax",
        "mixtral", "minimax", "qwen2_moe", "qwen3_moe", "qwen3_next", "olmoe", "hunyuan_v1_moe", "jamba",
        "gpt_oss", "granitemoe", "granitemoeshared", "granitemoe_swa", "granitemoehybrid", "phimoe", "dbrx",
        "flex_olmo", "aria", "aria_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_vl_moe", "qwen4_exp",
        "qwen4_exp_text", "mistral4", "mistral_large4", "lara_mini", "mellum",
    ),
    "qwen3_omni_moe": Family("softmax", note="text goes to its thinker, which moeviz loads alone"),
    "qwen3_omni_moe_thinker": Family("softmax"),
    **_rows("softmax", "deepseek_v2", "deepseek_ocr2", "unlimited_ocr", note="group-limited (group max)"),
    **_rows("softmax", "ernie4_5_moe", "ernie4_5_vl_moe", note="selection on softmax + moe_statics bias"),
    "longcat_flash": Family(
        "softmax", note="zero-computation (identity) experts after the routed ones: counted apart"
    ),
    "zaya": Family(
        "softmax",
        decoder="zaya_skip",
        note="a skip class after the routed experts (a zero-computation expert): counted apart",
    ),
    **_rows(
        "softmax",
        "gemma4",
        "gemma4_text",
        note="the router returns probabilities (logits recorded as log p); weights × per-expert scale",
        outputs_probabilities=True,
    ),
    "cohere2_moe": Family(None, note="top-k on the logits; softmax or sigmoid of the k: expert_selection_fn"),
    # sigmoid routers, mostly DeepSeek-V3's rule (selection on sigmoid + bias, often within groups)
    **_rows(
        "sigmoid",
        "deepseek_v3", "deepseek_v32", "glm4_moe", "glm4_moe_lite", "glm4v_moe", "glm5_next", "glm_moe_dsa",
        "kimi_linear", "kimi_k25", "afmoe", "axk1", "axk2", "bailing_hybrid", "beam", "dots1", "dots3_note",
        "dots3_note_text", "exaone_moe", "flint", "minimax_m2", "minimax_m3_vl", "minimax_m3_vl_text",
        "muse_spark", "nemotron_h", "solar_open", "step3p7", "lfm2_moe", "inkling2", "inkling2_text",
        "mimo_v2_flash", "hy_v3", "hy_v4", "hy_v4_vl",
    ),
    "laguna": Family("sigmoid", note="logits soft-capped (tanh) before the sigmoid; recorded capped"),
    **_rows(
        "sigmoid",
        "inkling_mm_model",
        "inkling_text",
        note="the shared experts' router logits share the weights' normalisation (not recorded)",
    ),
    **_rows(
        "sigmoid",
        "inkling2_loop",
        "inkling2_loop_text",
        note="looped blocks: each pass is recorded as its own layer occurrence",
    ),
    "kolibri1": Family("sigmoid", bias_on="logits", note="selection on the raw logits + bias"),
    "deepseek_v4": Family(
        "sqrtsoftplus",
        support="hash table",
        note="the first MoE layers choose experts by a token-id table (tid2eid); the scores only weight them",
    ),
    # families whose experts module does not receive the decision
    **_rows("sigmoid", "llama4", "llama4_text", decoder="sigmoid_router_scores", support="router output"),
    "jetmoe": Family("softmax", decoder="sorted_gating", support="router output", note="attention experts"),
    "doge": Family(
        "softmax",
        decoder="product_keys",
        support="router output",
        note="product-key router: expert i·K + j scores x_i + y_j (transformers' reshape pairs halves of "
        "neighbouring tokens in a multi-token forward; the routing recorded is what the model did)",
    ),
    "switch_transformers": Family("softmax", decoder="one_hot_mask", note="top-1 with expert capacity"),
    "nllb-moe": Family(
        "softmax",
        decoder="dense_weights",
        note="top-2 with capacity; transformers 5.24 dispatches only experts 0 and 1 (an upstream bug)",
    ),
    # refused
    "diffusion_gemma": Family(
        "softmax",
        support="refused",
        note="a block-diffusion model (prompt encoder + canvas denoiser): not an autoregressive text model",
    ),
    "openai_privacy_filter": Family(
        "softmax",
        note="a token classifier (bidirectional encoder): routing only, no next-token predictions",
    ),
    **_rows(
        None,
        "gemma4_unified",
        "gemma4_unified_text",
        "granite_docling",
        support="refused",
        note=_DENSE,
    ),
}  # fmt: skip

# Text-model configs that transformers builds only inside a composite checkpoint (no auto class builds them
# alone): looked up by `find_moe_sites` in the composite, never a checkpoint of their own.
SUBMODELS = {
    "ernie4_5_vl_moe_text": "ernie4_5_vl_moe",
    "deepseek_ocr2_text": "deepseek_ocr2",
    "unlimited_ocr_text": "unlimited_ocr",
    "glm4v_moe_text": "glm4v_moe",
    "glm5_next_text": "glm5_next",
    "mistral_large4_text": "mistral_large4",
    "muse_spark_text": "muse_spark",
    "step3p5": "step3p7",
    "hy_v4_vl_text": "hy_v4_vl",
    "qwen3_vl_moe_text": "qwen3_vl_moe",
    "qwen3_omni_moe_text": "qwen3_omni_moe_thinker",
    "diffusion_gemma_text": "diffusion_gemma",
    "granite_docling_text": "granite_docling",
}

FAMILIES: dict[str, Family] = {
    **_CHECKPOINTS,
    **{sub: _CHECKPOINTS[parent] for sub, parent in SUBMODELS.items()},
}


def family(model_type: str | None) -> Family | None:
    """The row of `model_type`; None for a model type transformers does not ship (remote code)."""
    return FAMILIES.get(model_type) if model_type is not None else None


def refusal(model_type: str | None) -> str | None:
    """Why moeviz refuses `model_type`, or None when it does not."""
    if model_type in SUBMODELS:
        parent = SUBMODELS[model_type]
        return f"the text model inside {parent} checkpoints, never built alone: load the {parent} model"
    row = family(model_type)
    return row.note if row is not None and row.support == "refused" else None


def markdown_table() -> str:
    """The README's family table: one row per checkpoint model type (sub-model configs listed below it)."""
    lines = ["| model type | capture | score | notes |", "|---|---|---|---|"]
    for model_type, row in sorted(_CHECKPOINTS.items()):
        score = "—" if row.support == "refused" else (row.score_fn or "from the config")
        lines.append(f"| `{model_type}` | {row.support} | {score} | {row.note} |")
    subs = ", ".join(f"`{sub}` (in `{parent}`)" for sub, parent in sorted(SUBMODELS.items()))
    lines += ["", f"Text-model configs transformers builds only inside a composite checkpoint: {subs}."]
    return "\n".join(lines)
