"""Router score functions, in fp32 numpy (top-k decisions are precision-sensitive), and expert capacity: the
capacity of a dispatch group and the order in which an over-full expert keeps its slots.

Capacity is computed once here for the capacity replay (`moeviz.whatif.capacity`), the routing playground
(`moeviz.analysis.reroute`) and the Lab (`moeviz.lab.train`, whose torch version is tested against
`capacity_ranks`)."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Literal, get_args

import numpy as np

# How a router turns logits into scores (`LayerRouting.score_fn`).
ScoreFn = Literal["softmax", "sigmoid", "sqrtsoftplus"]
SCORE_FUNCTIONS: tuple[ScoreFn, ...] = get_args(ScoreFn)
# Elementwise score functions: a token's score for one expert depends on that expert's logit alone.
ELEMENTWISE_SCORES: tuple[ScoreFn, ...] = ("sigmoid", "sqrtsoftplus")
# What a balancing bias is added to for selection (`LayerRouting.bias_on`): the scores (DeepSeek-V3 and most)
# or the raw logits (Kolibri-1).
BiasOn = Literal["scores", "logits"]
BIAS_ON: tuple[BiasOn, ...] = get_args(BiasOn)
# How group-limited routing ranks a group of experts (`LayerRouting.group_score`): the sum of its two best
# selection scores (DeepSeek-V3, GLM-4.5, Kimi) or its best one (DeepSeek-V2).
GroupScore = Literal["top2_sum", "max"]
GROUP_SCORES: tuple[GroupScore, ...] = get_args(GroupScore)


def scores_from_logits(logits: np.ndarray, score_fn: str) -> np.ndarray:
    """Router scores [N, E] from raw logits [N, E]: softmax over experts, or elementwise sigmoid, or
    sqrt(softplus(x)) (DeepSeek-V4's `sqrtsoftplus`, softplus(x) = log(1 + e^x) computed without overflow)."""
    logits = logits.astype(np.float32, copy=False)
    if score_fn == "softmax":
        shifted = logits - logits.max(axis=-1, keepdims=True)
        exp = np.exp(shifted)
        return exp / exp.sum(axis=-1, keepdims=True)
    if score_fn == "sigmoid":
        return 1.0 / (1.0 + np.exp(-logits))
    if score_fn == "sqrtsoftplus":
        return np.sqrt(np.logaddexp(np.float32(0), logits))
    raise ValueError(f"unknown score function {score_fn!r} (expected one of {', '.join(SCORE_FUNCTIONS)})")


def selection_scores(scores: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """What experts are selected on: scores plus the balancing bias, where the router has one."""
    return scores if bias is None else scores + bias.astype(np.float32)


def expert_capacity(tokens, k: int, experts: int, cf: float, exact: bool = False):
    """Slots per expert of a dispatch group of `tokens` tokens (an int, or an array [G] of group sizes →
    [G] int64), ceil((tokens·k / experts)·cf): Megatron's float order by default (NVIDIA/Megatron-LM
    moe_utils.get_capacity; numpy float64 does the same IEEE operations as its Python floats, which can land
    one above the exact value: T=440, k=2, E=8, CF=1.1 → 122, exact 121), or exact rational arithmetic with
    cf read as the decimal it prints as."""
    if np.ndim(tokens) == 0:
        if exact:
            return math.ceil(Fraction(int(tokens) * k, experts) * Fraction(repr(float(cf))))
        return math.ceil((int(tokens) * k / experts) * cf)
    tokens = np.asarray(tokens, dtype=np.int64)
    if exact:
        frac = Fraction(repr(float(cf)))
        return np.array(
            [-(-int(t) * k * frac.numerator // (experts * frac.denominator)) for t in tokens], dtype=np.int64
        )
    return np.ceil((tokens * k / experts) * cf).astype(np.int64)


def _descending_key(priority: np.ndarray) -> np.ndarray:
    """float32 priorities → uint32 keys whose ascending order is the priorities' descending order."""
    bits = np.asarray(priority, dtype=np.float32).view(np.int32).astype(np.int64)
    ascending = np.where(bits < 0, ~bits & 0x7FFFFFFF, bits | 0x80000000)
    return 0xFFFFFFFF - ascending


def capacity_ranks(cell: np.ndarray, priority: np.ndarray | None = None) -> np.ndarray:
    """Rank [A] of each of A slot assignments within its cell (a dispatch group × expert id, e.g.
    group · E + expert), given in arrival order (token, then slot): the order in which an over-full expert
    keeps its slots. With `priority` [A] (the ``probs`` drop policy: a combination weight or router
    probability) the highest first, ties → arrival; without it (the ``position`` policy) arrival order.
    A slot survives a capacity C exactly when its rank < C."""
    cell = np.asarray(cell, dtype=np.int64)
    if priority is not None:  # one packed key; the stable sort keeps arrival order on ties
        order = np.argsort((cell << 32) | _descending_key(priority), kind="stable")
    else:
        small = cell.max(initial=0) < 2**16  # radix sort for 16-bit keys
        order = np.argsort(cell.astype(np.uint16) if small else cell, kind="stable")
    sorted_cell = cell[order]
    first = np.r_[True, sorted_cell[1:] != sorted_cell[:-1]] if len(order) else np.zeros(0, bool)
    start = np.maximum.accumulate(np.where(first, np.arange(len(order)), 0)) if len(order) else first
    rank = np.empty(len(cell), dtype=np.int64)
    rank[order] = np.arange(len(order)) - start
    return rank
