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

from moeviz.scoring import ELEMENTWISE_SCORES, SCORE_FUNCTIONS
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

    Softmax routers: the scores themselves. Sigmoid (and sqrtsoftplus) routers: scores normalised to sum 1
    per token (an all-zero row, only possible by underflow, becomes uniform).
    """
    return normalise_scores(routing.scores, routing.score_fn)


def normalise_scores(scores: np.ndarray, score_fn: str) -> np.ndarray:
    """Scores [N, E] → per-token distribution [N, E]: softmax as is, an elementwise score (sigmoid,
    sqrtsoftplus) divided by the row sum."""
    scores = np.asarray(scores, dtype=np.float32)
    if score_fn == "softmax":
        return scores
    if score_fn not in ELEMENTWISE_SCORES:
        raise ValueError(
            f"unknown score function {score_fn!r} (expected one of {', '.join(SCORE_FUNCTIONS)})"
        )
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


def _switch_product(probs: np.ndarray, chosen: np.ndarray) -> float:
    """E · Σ_e f_e P_e from router probabilities [N, E] and chosen expert ids [N, k'] (-1 = none), with
    f_e = (# tokens whose choice includes e) / N, not divided by k. NaN for N = 0."""
    n, e = probs.shape
    if n == 0:
        return float("nan")
    f = np.bincount(chosen[chosen >= 0], minlength=e) / n
    p_mean = probs.sum(axis=0, dtype=np.float64) / n
    return float(e * (f * p_mean).sum())


def aux_loss_top1(probs: np.ndarray) -> float:
    """Switch Transformers' auxiliary loss E · Σ_e f_e P_e from router probabilities [N, E], f from each
    token's top-1 (uniform value 1). NaN for N = 0."""
    probs = np.asarray(probs)
    return _switch_product(probs, top_k_indices(probs, 1, ordered=False))


def aux_loss_topk(probs: np.ndarray, top_k: int) -> float:
    """The top-k generalisation E · Σ_e f_e P_e (transformers' `load_balancing_loss_func`, one layer), f
    from the top-`top_k` of `probs` [N, E], not divided by k: uniform value k. NaN for N = 0."""
    probs = np.asarray(probs)
    return _switch_product(probs, top_k_indices(probs, top_k, ordered=False))


def aux_loss_megatron(probs: np.ndarray, top_k: int) -> float:
    """Megatron-Core's auxiliary loss (since mid-2025): the top-k form with f divided by k, f_e = c_e/(kT)
    from a plain top-k of the unbiased `probs` [N, E]; uniform value 1. = aux_loss_topk / k. The Lab trains
    on this form. NaN for N = 0."""
    return aux_loss_topk(probs, top_k) / top_k


def aux_loss_dispatched(probs: np.ndarray, experts: np.ndarray) -> float:
    """The auxiliary loss with f from the experts actually dispatched [N, k] (-1 = a dropped slot, counted
    for no expert), not divided by k: Megatron-Core's routing-map form before mid-2025 (uniform value k).
    Equals aux_loss_topk for a plain top-k router without drops. NaN for N = 0."""
    return _switch_product(np.asarray(probs), np.asarray(experts))


def aux_loss_topk_pooled(routings: Sequence[LayerRouting], top_k: int | None = None) -> float:
    """`aux_loss_topk` over several layers pooled into one, as transformers' `load_balancing_loss_func`
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
class AuxLossForm:
    """One form of the auxiliary balancing loss: what it is and its value under perfectly even load
    ("1", or "k" = the layer's slots per token)."""

    description: str
    balanced: str

    def balanced_value(self, top_k: int) -> float:
        return float(top_k) if self.balanced == "k" else 1.0


# Every auxiliary-loss value moeviz shows is named by its form: a column of `loss_frame`, a key of the
# report's JSON, a line of the Lab's history. Even load means f_e = k/E for every expert (f not divided by
# k), and then E · Σ_e f_e P_e = k · Σ_e P_e = k whatever P; the forms that divide f by k read 1
# (docs/routing-metrics.md, "Balancing losses").
AUX_LOSS_FORMS: dict[str, AuxLossForm] = {
    "aux_loss_top1": AuxLossForm(
        "Switch Transformers / GShard, E·Σ_e f_e·P_e with f from each token's top-1", "1"
    ),
    "aux_loss_topk": AuxLossForm(
        "the top-k generalisation (transformers' load_balancing_loss_func, Mixtral): f from the top-k, "
        "not divided by k",
        "k",
    ),
    "aux_loss_megatron": AuxLossForm(
        "Megatron-Core since mid-2025, and the Lab's training loss: the top-k form with f divided by k "
        "(f_e = c_e/(kT) from a plain top-k of the unbiased scores), aux_loss_topk / k",
        "1",
    ),
    "aux_loss_dispatched": AuxLossForm(
        "Megatron-Core's routing-map form before mid-2025: f from the experts actually dispatched (after a "
        "balancing bias, group limits and capacity drops), here not divided by k",
        "k",
    ),
    "seq_aux_loss": AuxLossForm(
        "DeepSeek-V3 sequence-wise balance loss: per sequence f_i = E/(kT)·(tokens on i), P from the scores "
        "normalised per token, mean over sequences",
        "1",
    ),
}


@dataclass(frozen=True)
class LossStats:
    """Balancing losses of one layer, unscaled (no α); each auxiliary loss is named by its form
    (AUX_LOSS_FORMS, which says what it is and its balanced value)."""

    aux_loss_top1: float
    aux_loss_topk: float
    aux_loss_megatron: float
    aux_loss_dispatched: float
    seq_aux_loss: float
    z_loss: float
    bias: BiasStats | None


def loss_stats(routing: LayerRouting, seqs: np.ndarray | None = None) -> LossStats:
    """Every balancing loss of one layer, replayed from its captured logits / scores. `seqs` [N]: the
    sequence of each routed token, for seq_aux_loss (None: the layer's tokens are one sequence).

    Routing imported without logits (`has_logits` False) has no losses: every one is NaN (a sigmoid
    router's all-NaN scores would otherwise normalise to uniform probabilities and give a false k)."""
    if not routing.has_logits:
        nan = float("nan")
        return LossStats(nan, nan, nan, nan, nan, nan, bias_stats(routing.bias))
    probs = router_probs(routing)
    topk = aux_loss_topk(probs, routing.k)
    return LossStats(
        aux_loss_top1=aux_loss_top1(probs),
        aux_loss_topk=topk,
        aux_loss_megatron=topk / routing.k,
        aux_loss_dispatched=aux_loss_dispatched(probs, routing.experts),
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
    *AUX_LOSS_FORMS,
    "z_loss",
    "has_bias",
    "bias_std",
    "bias_max_abs",
    "bias_range",
    "bias_flagged",
]


def loss_frame(trace: Trace) -> pd.DataFrame:
    """One row per MoE layer (site, layer): the unscaled losses of LossStats, one column per form of
    AUX_LOSS_FORMS (seq_aux_loss per sequence of the trace), and the bias spread; columns LOSS_COLUMNS
    (bias_* NaN and bias_flagged False for routers without a bias)."""
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
                **{form: getattr(s, form) for form in AUX_LOSS_FORMS},
                "z_loss": s.z_loss,
                "has_bias": s.bias is not None,
                "bias_std": nan if s.bias is None else s.bias.std,
                "bias_max_abs": nan if s.bias is None else s.bias.max_abs,
                "bias_range": nan if s.bias is None else s.bias.range,
                "bias_flagged": False if s.bias is None else s.bias.flagged,
            }
        )
    return pd.DataFrame(rows, columns=LOSS_COLUMNS)


def aux_loss_frame(losses: pd.DataFrame) -> pd.DataFrame:
    """One row per layer: each auxiliary loss of AUX_LOSS_FORMS next to its balanced value (column
    `<form>_balanced`: 1 or k), and the router z-loss (no balanced value: it measures the size of the logits).

    Input: `loss_frame(trace)`."""
    data = losses[["layer", "site", "experts", "top_k"]].copy()
    k = losses["top_k"].astype(np.float64)
    for column, form in AUX_LOSS_FORMS.items():
        data[column] = losses[column].astype(np.float64)
        data[f"{column}_balanced"] = k if form.balanced == "k" else 1.0
    data["z_loss"] = losses["z_loss"].astype(np.float64)
    return data.reset_index(drop=True)


def _aux_loss(probs: np.ndarray, top_k: int = 1, selected: np.ndarray | None = None) -> float:
    """The 0.1 `aux_loss`: aux_loss_dispatched with `selected`, else aux_loss_topk (top_k = 1: top-1)."""
    if selected is not None:
        return aux_loss_dispatched(probs, selected)
    return aux_loss_topk(probs, top_k)


_RENAMED = {
    "aux_loss": ("aux_loss_topk / aux_loss_dispatched", _aux_loss),
    "aux_loss_pooled": ("aux_loss_topk_pooled", aux_loss_topk_pooled),
}


def deprecated(name: str, where: str):
    """A renamed function under its 0.1 name, with a DeprecationWarning; AttributeError for anything else."""
    import warnings

    if name not in _RENAMED:
        raise AttributeError(f"module {where.rsplit('.', 1)[0]!r} has no attribute {name!r}")
    new, function = _RENAMED[name]
    warnings.warn(
        f"{where} is deprecated: use {new} (each aux loss is named by its form)",
        DeprecationWarning,
        stacklevel=3,
    )
    return function


def __getattr__(name: str):
    return deprecated(name, f"moeviz.analysis.losses.{name}")
