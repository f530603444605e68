"""Router score functions, in fp32 numpy (top-k decisions are precision-sensitive), and expert capacity."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np


def scores_from_logits(logits: np.ndarray, score_fn: str) -> np.ndarray:
    """Router scores [N, E] from raw logits [N, E]: softmax over experts, or elementwise sigmoid."""
    logits = logits.astype(np.float32, copy=False)
    if score_fn == "softmax":
        shifted = logits - logits.max(axis=-1, keepdims=True)
        exp = np.exp(shifted)
        return exp / exp.sum(axis=-1, keepdims=True)
    if score_fn == "sigmoid":
        return 1.0 / (1.0 + np.exp(-logits))
    raise ValueError(f"unknown score function {score_fn!r} (expected 'softmax' or 'sigmoid')")


def selection_scores(scores: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """What experts are selected on: scores plus the balancing bias, where the router has one."""
    return scores if bias is None else scores + bias.astype(np.float32)


def expert_capacity(tokens: int, k: int, experts: int, cf: float, exact: bool = False) -> int:
    """Slots per expert of one dispatch group, ceil((tokens·k / experts)·cf): Megatron's float order by
    default (NVIDIA/Megatron-LM moe_utils.get_capacity), or exact rational arithmetic with cf read as the
    decimal it prints as."""
    if exact:
        return math.ceil(Fraction(tokens * k, experts) * Fraction(repr(float(cf))))
    return math.ceil((tokens * k / experts) * cf)
