"""Balancing losses as the model would see them, replayed from captured router logits.

Definitions (docs/routing-metrics.md, "Balancing losses"):
- Switch / GShard auxiliary loss L = E · Σ_e f_e P_e, reported without its coefficient α.
  P_e = mean_t p[t,e] over the router's probability distribution p (see `router_probs`).
  f_e = fraction of tokens whose top-1 (Switch) or top-k (generalised form) includes e. The top-k form
  does NOT divide f by k: Σ_e f_e = k and the uniform value of L is k, exactly as transformers'
  `load_balancing_loss_func` (the reference this module is tested against). Megatron-Core divides f by k
  (f_e = c_e / (kT), uniform value 1) and, since mid-2025, takes c from a plain top-k of the unbiased
  scores whatever the router's bias or group limits: its logged value (α = 1) is aux_loss_topk / k.
- DeepSeek-V3 sequence-wise balance loss (arXiv 2412.19437 eq. 17–20), `seq_aux_loss`: the same product
  per sequence with f_i = E/(kT) Σ_t 1[i ∈ top-k(s_t)] and P_i = mean_t s'[t,i] (s' = scores normalised
  to sum 1 per token), averaged over sequences; unscaled, uniform value 1.
- ST-MoE router z-loss: mean_t (logsumexp_e logit[t,e])², on raw logits whatever the score function.
- Loss-free balancing (DeepSeek-V3): the bias vector and its spread; Megatron-Core flags std > 1 and
  |b| > 5 (`BIAS_STD_FLAG`, `BIAS_ABS_FLAG`).

Sigmoid routers: their scores do not sum to 1, so p[t,e] = s[t,e] / Σ_e s[t,e] (the normalised sigmoid
scores) for P_e; the top-k sets are unchanged by this normalisation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from moeviz.trace import LayerRouting, Trace

BIAS_STD_FLAG = 1.0  # Megatron-Core: a bias spread above this means balancing is fighting the router
BIAS_ABS_FLAG = 5.0  # Megatron-Core: any |b_e| above this


# Row reductions over the short expert axis. numpy's reduce along a length-E (≈8) last axis is ~10× slower
# than reducing a transposed, contiguous copy along its first axis, which vectorises across the N tokens.
def rowwise_max(a: np.ndarray) -> np.ndarray:
    """max over the last axis of [N, E] → [N]."""
    return np.ascontiguousarray(a.T).max(axis=0) if a.shape[1] else np.full(a.shape[0], -np.inf, a.dtype)


def rowwise_min(a: np.ndarray) -> np.ndarray:
    """min over the last axis of [N, E] → [N]."""
    return np.ascontiguousarray(a.T).min(axis=0) if a.shape[1] else np.full(a.shape[0], np.inf, a.dtype)


def rowwise_sum(a: np.ndarray) -> np.ndarray:
    """sum over the last axis of [N, E] → [N], in a's dtype."""
    return np.ascontiguousarray(a.T).sum(axis=0)


def router_probs(routing: LayerRouting) -> np.ndarray:
    """The router's probability distribution over experts [N, E], fp32, rows summing to 1.

    Softmax routers: the scores themselves. Sigmoid routers: scores normalised to sum 1 per token (an all-zero
    row, only possible by underflow, becomes uniform).
    """
    return normalise_scores(routing.scores, routing.score_fn)


def normalise_scores(scores: np.ndarray, score_fn: str) -> np.ndarray:
    """Scores [N, E] → per-token distribution [N, E]: softmax as is, sigmoid divided by the row sum."""
    scores = np.asarray(scores, dtype=np.float32)
    if score_fn == "softmax":
        return scores
    if score_fn != "sigmoid":
        raise ValueError(f"unknown score function {score_fn!r} (expected 'softmax' or 'sigmoid')")
    total = rowwise_sum(scores)[:, None]
    uniform = np.float32(1.0 / max(scores.shape[1], 1))
    return np.divide(scores, total, out=np.full_like(scores, uniform), where=total > 0)


def top_k_indices(values: np.ndarray, k: int, ordered: bool = True) -> np.ndarray:
    """Indices [N, k] of the k largest values per row of [N, E], in descending order of value (any order
    with `ordered=False`, which skips a sort where only the set matters)."""
    n, e = values.shape
    if not 1 <= k <= e:
        raise ValueError(f"top-k needs 1 <= k <= E, got k={k}, E={e}")
    if k == 1:
        return np.ascontiguousarray(values.T).argmax(axis=0)[:, None]  # fast on a short axis
    part = np.argpartition(-values, k - 1, axis=1)[:, :k] if k < e else np.tile(np.arange(e), (n, 1))
    if not ordered:
        return part
    order = np.argsort(-np.take_along_axis(values, part, axis=1), axis=1, kind="stable")
    return np.take_along_axis(part, order, axis=1)


def aux_loss(probs: np.ndarray, top_k: int = 1, selected: np.ndarray | None = None) -> float:
    """Switch/GShard auxiliary loss E · Σ_e f_e P_e (unscaled) from router probabilities [N, E].

    f_e = (# tokens whose selection includes e) / N, not divided by k (uniform value: k). The selection is
    the top-`top_k` of `probs`, or `selected` [N, k'] expert ids where given (-1 = none, e.g. a dropped slot).
    NaN for N = 0.
    """
    probs = np.asarray(probs)
    n, e = probs.shape
    if n == 0:
        return float("nan")
    chosen = top_k_indices(probs, top_k, ordered=False) if selected is None else np.asarray(selected)
    f = np.bincount(chosen[chosen >= 0], minlength=e) / n
    p_mean = probs.sum(axis=0, dtype=np.float64) / n
    return float(e * (f * p_mean).sum())


def aux_loss_pooled(routings: Sequence[LayerRouting], top_k: int | None = None) -> float:
    """The auxiliary loss over several layers pooled into one, as transformers' `load_balancing_loss_func`
    computes it from a tuple of per-layer logits: f and P are averaged over all (layer, token) rows together,
    then L = E Σ f P (not the mean of per-layer losses). `top_k` defaults to the layers' k.
    All layers must have the same E. NaN when there are no rows.
    """
    if not routings:
        return float("nan")
    e = routings[0].num_experts
    if any(r.num_experts != e for r in routings):
        raise ValueError(
            f"pooled aux loss needs the same number of experts in every layer, got "
            f"{sorted({r.num_experts for r in routings})}"
        )
    k = routings[0].k if top_k is None else top_k
    counts = np.zeros(e, dtype=np.float64)
    prob_sum = np.zeros(e, dtype=np.float64)
    rows = 0
    for routing in routings:
        probs = router_probs(routing)
        if len(probs) == 0:
            continue
        counts += np.bincount(top_k_indices(probs, k, ordered=False).reshape(-1), minlength=e)
        prob_sum += probs.sum(axis=0, dtype=np.float64)
        rows += len(probs)
    if rows == 0:
        return float("nan")
    return float(e * ((counts / rows) * (prob_sum / rows)).sum())


def seq_aux_loss(
    probs: np.ndarray,
    seqs: np.ndarray | None = None,
    top_k: int = 1,
    selected: np.ndarray | None = None,
) -> float:
    """DeepSeek-V3's sequence-wise balance loss (arXiv 2412.19437 eq. 17–20), unscaled (α = 1), averaged
    over sequences.

    For each sequence of T tokens: f_i = E/(k·T) Σ_t 1[i ∈ S_t], P_i = (1/T) Σ_t p[t,i], L = Σ_i f_i P_i;
    1 when the sequence is perfectly balanced (f_i = 1, P_i = 1/E). probs [N, E]: per-token distribution
    (sigmoid scores normalised to sum 1 per token, as `router_probs` gives them). seqs [N]: the sequence of
    each row (None = all rows are one sequence). S_t: the top-`top_k` of probs, as in the paper (the
    unbiased scores: a balancing bias or a capacity drop does not enter), or `selected` [N, k'] expert ids
    where given (-1 = none; k = k'). NaN for N = 0.
    """
    probs = np.asarray(probs)
    n, e = probs.shape
    if n == 0:
        return float("nan")
    chosen = top_k_indices(probs, top_k, ordered=False) if selected is None else np.asarray(selected)
    k = chosen.shape[1]
    _, inverse = np.unique(np.zeros(n) if seqs is None else np.asarray(seqs), return_inverse=True)
    inverse = inverse.reshape(-1)
    num_seqs = int(inverse.max()) + 1
    tokens = np.bincount(inverse, minlength=num_seqs).astype(np.float64)  # T per sequence
    flat = chosen.reshape(-1)
    valid = flat >= 0  # a dropped slot (-1) counts for no expert
    hits = np.bincount(np.repeat(inverse, k)[valid] * e + flat[valid], minlength=num_seqs * e)
    f = hits.reshape(num_seqs, e) * (e / (k * tokens[:, None]))
    p_sum = [np.bincount(inverse, weights=probs[:, i], minlength=num_seqs) for i in range(e)]
    p_mean = np.stack(p_sum, axis=1) / tokens[:, None]
    return float((f * p_mean).sum(axis=1).mean())


def logsumexp_rows(logits: np.ndarray) -> np.ndarray:
    """log Σ_e exp(logit[t,e]) per row [N] of [N, E], computed stably (max-shifted) in fp32."""
    logits = np.asarray(logits, dtype=np.float32)
    if logits.shape[0] == 0:
        return np.zeros(0, dtype=np.float32)
    peak = rowwise_max(logits)
    return peak + np.log(rowwise_sum(np.exp(logits - peak[:, None])))


def z_loss(logits: np.ndarray) -> float:
    """ST-MoE router z-loss mean_t (logsumexp_e logit[t,e])² of raw logits [N, E], unscaled; NaN for N = 0."""
    lse = logsumexp_rows(logits).astype(np.float64)
    return float((lse * lse).mean()) if len(lse) else float("nan")


@dataclass(frozen=True)
class BiasStats:
    """Spread of a balancing bias vector [E] (population std) and Megatron-Core's two flags."""

    std: float
    max_abs: float
    range: float  # max b − min b
    std_flag: bool  # std > BIAS_STD_FLAG
    abs_flag: bool  # max |b| > BIAS_ABS_FLAG

    @property
    def flagged(self) -> bool:
        return self.std_flag or self.abs_flag


def bias_stats(bias: np.ndarray | None) -> BiasStats | None:
    """Spread of a balancing bias [E]; None for routers without one."""
    if bias is None:
        return None
    b = np.asarray(bias, dtype=np.float64)
    if b.size == 0:
        return BiasStats(0.0, 0.0, 0.0, False, False)
    std, max_abs = float(b.std()), float(np.abs(b).max())
    return BiasStats(
        std=std,
        max_abs=max_abs,
        range=float(b.max() - b.min()),
        std_flag=std > BIAS_STD_FLAG,
        abs_flag=max_abs > BIAS_ABS_FLAG,
    )


@dataclass(frozen=True)
class LossStats:
    """Balancing losses of one layer, unscaled (no α).

    aux_loss_top1: f from each token's top-1 of p (Switch form; uniform value 1).
    aux_loss_topk: f from the top-k of p, k = the layer's slots (transformers' form; uniform value k).
    It is the form Megatron-Core computes since mid-2025 (a plain top-k of the unbiased scores, ignoring
    bias and group limits), except that Megatron divides f by k: its logged value is aux_loss_topk / k.
    aux_loss_dispatched: f from the experts actually dispatched (biased or group-limited selection, drops
    count for no expert), the routing-map form Megatron-Core used before mid-2025; equals aux_loss_topk
    for a plain top-k router without drops.
    seq_aux_loss: DeepSeek-V3's sequence-wise balance loss (`seq_aux_loss`), top-k of the unbiased
    scores per sequence, mean over sequences; uniform value 1.
    """

    aux_loss_top1: float
    aux_loss_topk: float
    aux_loss_dispatched: float
    seq_aux_loss: float
    z_loss: float
    bias: BiasStats | None


def loss_stats(routing: LayerRouting, seqs: np.ndarray | None = None) -> LossStats:
    """Every balancing loss of one layer, replayed from its captured logits / scores. `seqs` [N]: the
    sequence of each routed token, for seq_aux_loss (None: the layer's tokens are one sequence)."""
    probs = router_probs(routing)
    return LossStats(
        aux_loss_top1=aux_loss(probs, 1),
        aux_loss_topk=aux_loss(probs, routing.k),
        aux_loss_dispatched=aux_loss(probs, selected=routing.experts),
        seq_aux_loss=seq_aux_loss(probs, seqs, routing.k),
        z_loss=z_loss(routing.logits),
        bias=bias_stats(routing.bias),
    )


LOSS_COLUMNS = [
    "layer",
    "site",
    "tokens",
    "experts",
    "top_k",
    "score_fn",
    "aux_loss_top1",
    "aux_loss_topk",
    "aux_loss_dispatched",
    "seq_aux_loss",
    "z_loss",
    "has_bias",
    "bias_std",
    "bias_max_abs",
    "bias_range",
    "bias_flagged",
]


def loss_frame(trace: Trace) -> pd.DataFrame:
    """One row per MoE layer (site, layer): the unscaled losses of LossStats (seq_aux_loss per sequence of
    the trace) and the bias spread; columns LOSS_COLUMNS (bias_* NaN and bias_flagged False for routers
    without a bias)."""
    rows = []
    nan = float("nan")
    token_seqs = trace.tokens["seq"].to_numpy()
    for routing in trace.layers:
        s = loss_stats(routing, token_seqs[routing.token_rows])
        rows.append(
            {
                "layer": routing.layer,
                "site": routing.site,
                "tokens": len(routing.token_rows),
                "experts": routing.num_experts,
                "top_k": routing.k,
                "score_fn": routing.score_fn,
                "aux_loss_top1": s.aux_loss_top1,
                "aux_loss_topk": s.aux_loss_topk,
                "aux_loss_dispatched": s.aux_loss_dispatched,
                "seq_aux_loss": s.seq_aux_loss,
                "z_loss": s.z_loss,
                "has_bias": s.bias is not None,
                "bias_std": nan if s.bias is None else s.bias.std,
                "bias_max_abs": nan if s.bias is None else s.bias.max_abs,
                "bias_range": nan if s.bias is None else s.bias.range,
                "bias_flagged": False if s.bias is None else s.bias.flagged,
            }
        )
    return pd.DataFrame(rows, columns=LOSS_COLUMNS)
