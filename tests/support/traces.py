"""Synthetic routing for the model-free tests: one LayerRouting / Trace builder and one Routes builder.

- `make_layer(experts, E, logits=None, ...)`: a LayerRouting with the given dispatch (-1 = a dropped slot);
  logits default to all-zero (a uniform router), weights to 1/k per dispatched slot.
- `routed_layer(logits, k)`: the layer a top-k router of those logits dispatches (weights renormalised).
- `make_tokens(seq_lengths, ...)` and `make_trace(layers, E, ...)`: a Trace over one or more sequences of
  one stream; a layer is a LayerRouting or an [N, k] array of experts.
- `make_layer_routes(experts, E, ...)` and `make_routes(layers, E, ...)`: the what-if simulators' Routes.
- random routing: `random_sets` (distinct experts per token), `random_layer` (top-k of random logits), and
  the hypothesis strategy `routing_cases` with `build_case`.
- reading back: `expert_sets`, `dense_weights`, `assert_traces_equal`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
from hypothesis import strategies as st

from moeviz.scoring import scores_from_logits
from moeviz.trace import TOKEN_COLUMNS, LayerRouting, ModelInfo, Trace
from moeviz.whatif.routes import LayerRoutes, Routes


# ---- LayerRouting and Trace ----------------------------------------------------------------------------
def make_layer(
    experts,
    num_experts: int,
    logits=None,
    *,
    weights=None,
    layer: int = 0,
    site: str = "mlp",
    token_rows=None,
    score_fn: str = "softmax",
    bias=None,
) -> LayerRouting:
    """A LayerRouting with the dispatch `experts` [N, k] ([N] = top-1; -1 = dropped) at `token_rows`
    (default 0 … N−1). `logits` [N, E] default to all-zero (uniform probabilities); `weights` [N, k] to
    1/k per dispatched slot and 0 for a dropped one."""
    experts = np.asarray(experts, dtype=np.int64)
    experts = experts[:, None] if experts.ndim == 1 else experts
    n = experts.shape[0]
    logits = np.zeros((n, num_experts), np.float32) if logits is None else np.asarray(logits, np.float32)
    if weights is None:
        weights = np.where(experts >= 0, 1.0 / max(experts.shape[1], 1), 0.0)
    return LayerRouting(
        layer=layer,
        site=site,
        token_rows=np.arange(n) if token_rows is None else np.asarray(token_rows),
        logits=logits,
        experts=experts,
        weights=np.asarray(weights, np.float32),
        score_fn=score_fn,
        bias=None if bias is None else np.asarray(bias, np.float32),
    )


def routed_layer(logits, k: int, *, score_fn: str = "softmax", renormalise: bool = True, **kwargs):
    """The layer a plain top-k router of `logits` dispatches: the k best scores (ties to the lower id),
    weighted by their scores, renormalised to sum to 1 when `renormalise`."""
    logits = np.asarray(logits, np.float32)
    scores = scores_from_logits(logits, score_fn)
    experts = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    weights = np.take_along_axis(scores, experts, axis=1)
    if renormalise:
        weights = weights / weights.sum(axis=1, keepdims=True)
    return make_layer(experts, logits.shape[1], logits, weights=weights, score_fn=score_fn, **kwargs)


def make_tokens(seq_lengths, token_ids=None, predicted=None, streams=None) -> pd.DataFrame:
    """The token table of sequences of the given lengths (one stream, prompt phase); ids default to
    0 … N−1 and each token's text is `t<id>`."""
    seq_lengths = list(seq_lengths)
    seq = np.repeat(np.arange(len(seq_lengths)), seq_lengths).astype(np.int64)
    pos = np.concatenate([np.arange(n) for n in seq_lengths]) if seq_lengths else np.zeros(0, np.int64)
    n = len(seq)
    ids = np.arange(n) if token_ids is None else np.asarray(token_ids)
    return pd.DataFrame(
        {
            "seq": seq,
            "pos": pos,
            "stream": ["input"] * n if streams is None else list(streams),
            "token_id": ids,
            "token": [f"t{i}" for i in ids],
            "phase": "prompt",
            "step": 0,
            "predicted_id": np.full(n, -1) if predicted is None else np.asarray(predicted),
        }
    )[TOKEN_COLUMNS]


def make_trace(
    layers: Sequence = (),
    num_experts: int | None = None,
    *,
    seq_lengths=None,
    token_rows=None,
    site: str = "mlp",
    token_ids=None,
    predicted=None,
    streams=None,
) -> Trace:
    """A Trace of `layers`: each a LayerRouting, or an [N_i, k] array of experts made the i-th layer by
    `make_layer` (of `num_experts`, at rows `token_rows[i]` or 0 … N_i−1, at `site`). The token table holds
    one sequence of every row a layer routes, or sequences of `seq_lengths`."""
    routings = []
    for i, item in enumerate(layers):
        if isinstance(item, LayerRouting):
            routings.append(item)
        else:
            rows = None if token_rows is None else token_rows[i]
            routings.append(make_layer(item, num_experts, layer=i, site=site, token_rows=rows))
    if seq_lengths is None:
        n = max((int(np.max(r.token_rows)) + 1 for r in routings if len(r.token_rows)), default=0)
        seq_lengths = [n]
    tokens = make_tokens(seq_lengths, token_ids=token_ids, predicted=predicted, streams=streams)
    info = ModelInfo(source="synthetic", model_type="test", architecture="test", num_layers=len(routings))
    return Trace(model=info, tokens=tokens, layers=routings)


# ---- Routes (the what-if simulators' input) --------------------------------------------------------------
def make_layer_routes(
    experts,
    num_experts: int,
    *,
    layer: int = 0,
    weights=None,
    seq=None,
    site: str = "decoder",
    n_group: int | None = None,
) -> LayerRoutes:
    """One layer's routes: `experts` [N, k] (-1 = dropped), `seq` [N] sorted sequence ids (default all 0),
    each token's position its place within its sequence; `weights` default to 1/k per dispatched slot."""
    experts = np.asarray(experts, dtype=np.int64)
    n = len(experts)
    seq = np.zeros(n, np.int64) if seq is None else np.asarray(seq, dtype=np.int64)
    pos = np.arange(n) - np.searchsorted(seq, seq, side="left") if n else np.zeros(0, np.int64)
    if weights is None:
        weights = np.where(experts >= 0, 1.0 / max(experts.shape[1], 1), 0.0)
    return LayerRoutes(
        layer=layer,
        site=site,
        experts=experts,
        weights=np.asarray(weights, dtype=np.float32),
        seq=seq,
        pos=pos.astype(np.int64),
        num_experts=num_experts,
        n_group=n_group,
    )


def make_routes(
    layers: Sequence,
    num_experts: int | None = None,
    *,
    weights: Sequence | None = None,
    seq=None,
    n_group: int | None = None,
    model: str = "toy",
) -> Routes:
    """Routes of `layers`: each a LayerRoutes, or an [N, k] array of experts made the i-th layer by
    `make_layer_routes` (with `weights[i]`, the shared `seq` and `n_group`)."""
    out = []
    for i, item in enumerate(layers):
        if isinstance(item, LayerRoutes):
            out.append(item)
        else:
            w = None if weights is None else weights[i]
            out.append(make_layer_routes(item, num_experts, layer=i, weights=w, seq=seq, n_group=n_group))
    return Routes(model=model, layers=out)


# ---- random routing --------------------------------------------------------------------------------------
def random_sets(rng: np.random.Generator, n: int, num_experts: int, k: int, p=None) -> np.ndarray:
    """[n, k] distinct experts per token (weighted by `p` without replacement, else uniform)."""
    scores = rng.random((n, num_experts))
    if p is not None:
        scores = scores ** (1 / np.asarray(p))  # Efraimidis–Spirakis weighted sampling without replacement
    return np.argsort(-scores, axis=1)[:, :k]


def random_layer(rng: np.random.Generator, n: int, e: int, k: int, skew: float = 1.0, drop: float = 0.0):
    """Top-k of random logits over n tokens, with per-expert offsets (`skew`) so the load is uneven and a
    `drop` fraction of slots dropped; weights 1/k."""
    logits = rng.normal(size=(n, e)) + skew * rng.normal(size=e)
    experts = np.argsort(-logits, axis=1, kind="stable")[:, :k]
    experts = np.where(rng.random((n, k)) < drop, -1, experts)
    return make_layer(experts, e, logits)


def routing_cases():
    """Hypothesis strategy of (seed, tokens, experts, k, drops) for `build_case`."""
    return st.tuples(
        st.integers(0, 2**32 - 1), st.integers(1, 60), st.integers(2, 9), st.integers(1, 4), st.booleans()
    )


def build_case(case) -> tuple[np.ndarray, int]:
    """(experts [n, k], E) of a `routing_cases` draw: Dirichlet-skewed sets; with drops, each token's last
    slots dropped (as captures order them)."""
    seed, n, e, k, drops = case
    k = min(k, e)
    rng = np.random.default_rng(seed)
    experts = random_sets(rng, n, e, k, rng.dirichlet(np.ones(e)))
    if drops:
        cut = rng.integers(0, k + 1, n)
        experts[np.arange(k)[None, :] >= cut[:, None]] = -1
    return experts, e


# ---- reading routing back ----------------------------------------------------------------------------------
def expert_sets(experts) -> list[set[int]]:
    """Each token's set of dispatched experts (dropped slots left out)."""
    return [{int(e) for e in row if e >= 0} for row in np.asarray(experts)]


def dense_weights(experts, weights, num_experts: int) -> np.ndarray:
    """[N, E] weight per (token, expert) of the dispatched experts (0 elsewhere)."""
    experts, weights = np.asarray(experts), np.asarray(weights)
    out = np.zeros((len(experts), num_experts))
    rows, slots = np.nonzero(experts >= 0)
    out[rows, experts[rows, slots]] = weights[rows, slots]
    return out


def assert_traces_equal(a: Trace, b: Trace, close: tuple[float, float] | None = None) -> None:
    """Token tables, model info and every layer's arrays and routing facts equal (bitwise); with `close`
    (rtol, atol) the float arrays (logits, scores, weights) within it instead: traces computed where sums
    may run in another order (thread counts, vector widths)."""
    pd.testing.assert_frame_equal(a.tokens, b.tokens)
    assert a.model == b.model
    assert len(a.layers) == len(b.layers)
    for x, y in zip(a.layers, b.layers, strict=True):
        for name in ("token_rows", "experts"):
            np.testing.assert_array_equal(getattr(x, name), getattr(y, name), err_msg=name)
        for name in ("logits", "scores", "selection_scores", "weights"):
            if close is None:
                np.testing.assert_array_equal(getattr(x, name), getattr(y, name), err_msg=name)
            else:
                rtol, atol = close
                np.testing.assert_allclose(getattr(x, name), getattr(y, name), rtol, atol, err_msg=name)
        facts = ("layer", "site", "score_fn", "decision_source", "top_k", "capacity")
        facts += ("has_logits", "has_weights", "ranked", "n_group", "topk_group", "group_score")
        assert [getattr(x, f) for f in facts] == [getattr(y, f) for f in facts]
        if x.bias is None:
            assert y.bias is None
        else:
            np.testing.assert_array_equal(x.bias, y.bias)


def load_table_collapsing_layer_0(layout, seed: int = 0):
    """An ExpertLoad of 3 steps for the model `layout` describes (a `moeviz.engines.layout.RoutingLayout`):
    counts of 5–39 tokens per expert (times k), except layer 0, where every token goes to expert 0 (which
    then holds half the slots)."""
    from moeviz.trace import ExpertLoad

    shape = (3, len(layout.moe_layers), layout.num_experts)
    counts = np.random.default_rng(seed).integers(5, 40, size=shape) * layout.top_k
    counts[:, 0, 0] = counts[:, 0, 1:].sum(axis=1)
    return ExpertLoad(
        model=layout.model_info([]),
        counts=counts.astype(np.int64),
        layers=list(layout.moe_layers),
        top_k=layout.top_k,
        source="sglang-dump",
    )
