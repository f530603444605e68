"""Random traces shaped like today's largest MoE models, built with numpy alone (no model, no torch), for
tests and benchmarks of views at scale.

`synthetic_trace` routes random logits exactly the DeepSeek-V3 way: sigmoid scores, selection on
score + bias within the best `topk_group` of `n_group` groups (group score = sum of its two best), weights
the renormalised unbiased scores. A per-expert logit offset makes the load uneven, as in a trained model.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from moeviz.scoring import scores_from_logits, selection_scores
from moeviz.trace import TOKEN_COLUMNS, LayerRouting, ModelInfo, Trace

# The run file of a store written from synthetic routing (no model, no corpus): every key
# `moeviz.store.run_file` requires, for `prepare_run(root, "synthetic", "final", SYNTHETIC_RUN)`
SYNTHETIC_RUN = {
    "source": "synthetic",
    "model_type": "synthetic",
    "corpus": None,
    "corpus_id": "synthetic",
    "chunk_tokens": None,
    "batch_size": 1,
    "max_batches": None,
    "confidence": False,
    "checkpoint_index": 0,
    "total_batches": None,
}
# (experts, k, n_group, topk_group, blocks, first dense blocks)
SHAPES = {
    "deepseek_v3": dict(num_experts=256, k=8, n_group=8, topk_group=4, num_blocks=61, first_dense=3),
    "kimi_k2": dict(num_experts=384, k=8, n_group=1, topk_group=1, num_blocks=61, first_dense=1),
}


def grouped_topk(selection: np.ndarray, k: int, n_group: int, topk_group: int) -> np.ndarray:
    """Experts [N, k] chosen on `selection` [N, E] within the best `topk_group` groups (DeepSeek-V3 rule),
    in descending order of selection score."""
    n, e = selection.shape
    masked = selection
    if n_group > 1 and topk_group < n_group:
        size = e // n_group
        grouped = selection.reshape(n, n_group, size)
        group_scores = -np.partition(-grouped, 1, axis=2)[:, :, :2].sum(axis=2)  # sum of the two best
        best = np.argpartition(-group_scores, topk_group - 1, axis=1)[:, :topk_group]
        keep = np.zeros((n, n_group), dtype=bool)
        np.put_along_axis(keep, best, True, axis=1)
        masked = np.where(np.repeat(keep, size, axis=1), selection, -np.inf)
    part = np.argpartition(-masked, k - 1, axis=1)[:, :k]
    order = np.argsort(-np.take_along_axis(masked, part, axis=1), axis=1, kind="stable")
    return np.take_along_axis(part, order, axis=1)


def synthetic_trace(
    num_experts: int = 256,
    k: int = 8,
    n_group: int = 8,
    topk_group: int = 4,
    num_blocks: int = 61,
    first_dense: int = 3,
    num_tokens: int = 1024,
    seed: int = 0,
    skew: float = 0.8,
) -> Trace:
    """A Trace of `num_tokens` tokens (one sequence) through MoE layers first_dense … num_blocks−1."""
    rng = np.random.default_rng(seed)
    layers = []
    grouped = n_group > 1 and topk_group < n_group
    for layer in range(first_dense, num_blocks):
        logits = (rng.normal(size=(num_tokens, num_experts)) + skew * rng.normal(size=num_experts)).astype(
            np.float32
        )
        scores = scores_from_logits(logits, "sigmoid")  # what the LayerRouting derives from the logits
        bias = (0.05 * rng.normal(size=num_experts)).astype(np.float32)
        selection = selection_scores(scores, bias)
        experts = grouped_topk(selection, k, n_group, topk_group)
        weights = np.take_along_axis(scores, experts, axis=1)
        weights = (weights / weights.sum(axis=1, keepdims=True) * 2.5).astype(np.float32)
        order = np.argsort(-weights, axis=1, kind="stable")  # slots by descending weight
        layers.append(
            LayerRouting(
                layer=layer,
                site="mlp",
                token_rows=np.arange(num_tokens),
                logits=logits,
                experts=np.take_along_axis(experts, order, axis=1).astype(np.int64),
                weights=np.take_along_axis(weights, order, axis=1),
                score_fn="sigmoid",
                bias=bias,
                top_k=k,
                shared_experts=1,
                n_group=n_group if grouped else None,
                topk_group=topk_group if grouped else None,
                group_score="top2_sum" if grouped else None,
            )
        )
    tokens = pd.DataFrame(
        {
            "seq": np.zeros(num_tokens, np.int64),
            "pos": np.arange(num_tokens),
            "stream": "input",
            "token_id": rng.integers(0, 50_000, num_tokens),
            "token": [f"w{i % 997}" for i in range(num_tokens)],
            "phase": "prompt",
            "step": 0,
            "predicted_id": -1,
        }
    )[TOKEN_COLUMNS]
    info = ModelInfo(
        source="synthetic", model_type="synthetic", architecture="synthetic", num_layers=num_blocks
    )
    return Trace(model=info, tokens=tokens, layers=layers)


def shaped_trace(name: str, num_tokens: int = 1024, seed: int = 0) -> Trace:
    """`synthetic_trace` in one of SHAPES ("deepseek_v3": 256 experts, top-8 from 4 of 8 groups, 58 MoE
    layers; "kimi_k2": 384 experts, top-8, no group limit, 60 MoE layers)."""
    return synthetic_trace(**SHAPES[name], num_tokens=num_tokens, seed=seed)
