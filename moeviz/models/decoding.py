"""Turn what a hook saw into the routing decision the model actually used.

Every decoder returns `(experts [N, k] int64, weights [N, k] float32)`: the dispatched expert ids
(-1 for a slot dropped by capacity) and the combination weights applied, slots ordered by descending
weight. Inputs are the router's forward output and, where the family passes the decision to its
`experts` module, that module's positional arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

Decision = tuple[torch.Tensor, torch.Tensor]


def sort_slots(experts: torch.Tensor, weights: torch.Tensor) -> Decision:
    """Order the k slots of each token by descending weight; dropped slots (-1) last, ties by expert id."""
    experts = experts.long()
    weights = weights.float()
    if experts.shape[1] == 1:
        return experts, weights
    if bool((weights[:, :-1] > weights[:, 1:]).all()) and bool((experts >= 0).all()):
        return experts, weights  # already in order (top-k output usually is): skip the sort
    # Lexicographic and exact (no packed float key): stable sorts from the least significant key up —
    # smaller expert id, then larger weight, then dropped last.
    order = torch.argsort(experts, dim=1, stable=True)
    for key in (-weights, (experts < 0).to(torch.int8)):
        order = order.gather(1, torch.argsort(key.gather(1, order), dim=1, stable=True))
    return experts.gather(1, order), weights.gather(1, order)


def from_expert_args(router_out: Any, args: Sequence[Any]) -> Decision:
    """Most families: `experts(hidden [N, H], top_k_index [N, k], top_k_weights [N, k])`."""
    idx, w = args[1], args[2]
    return sort_slots(idx.reshape(-1, idx.shape[-1]), w.reshape(-1, w.shape[-1]))


def from_one_hot_mask(router_out: Any, args: Sequence[Any]) -> Decision:
    """Switch: `experts(hidden, dispatch [N, 1, E] one-hot, probs [N, 1])`; an all-zero row was dropped."""
    mask, probs = args[1].reshape(args[1].shape[0], -1), args[2].reshape(-1)
    kept = mask.sum(dim=1) > 0
    experts = torch.where(kept, mask.argmax(dim=1), torch.full_like(kept, -1, dtype=torch.long))
    weights = torch.where(kept, probs.float(), torch.zeros_like(probs, dtype=torch.float32))
    return experts[:, None], weights[:, None]


def from_dense_weights(router_out: Any, args: Sequence[Any], k: int = 2) -> Decision:
    """NLLB: `experts(hidden, mask [N, E], combine_weights [N, E])`; used experts have non-zero weight."""
    combine = args[2].float()
    weights, experts = torch.topk(combine, k, dim=1)
    experts = torch.where(weights > 0, experts, torch.full_like(experts, -1))
    return sort_slots(experts, torch.where(weights > 0, weights, torch.zeros_like(weights)))


def from_sigmoid_router_scores(router_out: Any, args: Sequence[Any]) -> Decision:
    """Llama4: the router returns (scores [N, E], logits [N, E]); scores = sigmoid of the top-k logits, 0
    elsewhere."""
    scores, logits = router_out[0].float(), router_out[1]
    k = int((scores > 0).sum(dim=1).max().item()) if scores.numel() else 1
    experts = torch.topk(logits.float(), max(k, 1), dim=1).indices
    return sort_slots(experts, scores.gather(1, experts))


def from_sorted_gating(router_out: Any, args: Sequence[Any]) -> Decision:
    """JetMoE: (index_sorted_experts [N·k], batch_index [N·k], batch_gates [N·k], expert_size [E],
    logits [N, E]).

    Entry j holds flattened slot `index_sorted_experts[j]` (= token·k + slot) of the expert whose block of
    `expert_size` entries contains j.
    """
    index_sorted, _, gates, expert_size, logits = router_out[:5]
    n_tokens, n_experts = logits.shape
    k = index_sorted.numel() // max(n_tokens, 1)
    sizes = torch.as_tensor(list(expert_size), dtype=torch.long, device=index_sorted.device)
    expert_of_entry = torch.repeat_interleave(torch.arange(n_experts, device=index_sorted.device), sizes)
    experts = torch.empty(n_tokens * k, dtype=torch.long, device=index_sorted.device)
    weights = torch.empty(n_tokens * k, dtype=torch.float32, device=index_sorted.device)
    experts[index_sorted] = expert_of_entry
    weights[index_sorted] = gates.float()
    return sort_slots(experts.view(n_tokens, k), weights.view(n_tokens, k))


def from_skip_class(router_out: Any, args: Sequence[Any]) -> Decision:
    """ZAYA: the router scores E experts and a skip class (id E, the last of its [N, E + 1] logits); a token
    that chose the skip class reaches `experts(hidden, index, weights)` as expert 0 with weight exactly 0
    (a softmax probability is never 0), which is decoded back to id E (a zero-computation expert)."""
    idx, w = args[1], args[2]
    experts, weights = idx.reshape(-1, idx.shape[-1]).long(), w.reshape(-1, w.shape[-1]).float()
    skip = router_out[0].shape[-1] - 1
    return sort_slots(torch.where((experts == 0) & (weights == 0), skip, experts), weights)


def product_key_logits(halves: torch.Tensor) -> torch.Tensor:
    """Doge's product-key router: halves [2, N, K] (the router output as the block reshapes it) → the score
    of every expert [N, K²], expert i·K + j scoring x[n, i] + y[n, j] (autograd kept)."""
    x, y = halves[0], halves[1]
    return (x[:, :, None] + y[:, None, :]).reshape(x.shape[0], -1)


def from_product_keys(router_out: Any, args: Sequence[Any], k: int = 2) -> Decision:
    """Doge: the block returns (hidden, router logits [2, N, K]); it keeps the k best pair scores
    x_i + y_j (expert i·K + j) and weights them by a softmax over those k."""
    scores, experts = torch.topk(product_key_logits(router_out[1].float()), k, dim=-1)
    return sort_slots(experts, torch.softmax(scores, dim=-1))


def from_router_tuple(router_out: Any, args: Sequence[Any]) -> Decision:
    """Generic: a router returning (logits [N, E], weights [N, k], index [N, k]) in any order."""
    found = _find_index_and_weights(router_out)
    if found is None:
        raise ValueError("router output carries no (index, weights) pair")
    return sort_slots(*found)


def _find_index_and_weights(out: Any) -> Decision | None:
    if not isinstance(out, (tuple, list)):
        return None
    ints = [t for t in out if torch.is_tensor(t) and not t.is_floating_point() and t.dim() == 2]
    floats = [t for t in out if torch.is_tensor(t) and t.is_floating_point() and t.dim() == 2]
    for idx in ints:
        for w in floats:
            if w.shape == idx.shape:
                return idx, w
    return None


def expert_args_look_like_decision(args: Sequence[Any]) -> bool:
    """True when `experts(...)` args are (hidden, index [N, k] int, weights [N, k] float)."""
    return (
        len(args) >= 3
        and torch.is_tensor(args[1])
        and torch.is_tensor(args[2])
        and not args[1].is_floating_point()
        and args[2].is_floating_point()
        and args[1].shape == args[2].shape
    )


def recompute_softmax_topk(k: int) -> Callable[[torch.Tensor], Decision]:
    """Last resort for unknown routers: softmax → top-k → renormalise. Not the model's own decision."""

    def decode(logits: torch.Tensor) -> Decision:
        probs = torch.softmax(logits.float(), dim=-1)
        w, idx = torch.topk(probs, k, dim=-1)
        return sort_slots(idx, w / w.sum(dim=-1, keepdim=True))

    return decode


DECODERS: dict[str, Callable[[Any, Sequence[Any]], Decision]] = {
    "expert_args": from_expert_args,
    "one_hot_mask": from_one_hot_mask,
    "dense_weights": from_dense_weights,
    "sigmoid_router_scores": from_sigmoid_router_scores,
    "sorted_gating": from_sorted_gating,
    "router_tuple": from_router_tuple,
    "product_keys": from_product_keys,
    "zaya_skip": from_skip_class,
}
# Decoders that need the number of experts per token (`MoESite.top_k`) passed as `k`.
NEEDS_TOP_K = {"product_keys"}
# Decoders that read the experts module's arguments (the others read the router output alone).
NEEDS_EXPERT_ARGS = {"expert_args", "one_hot_mask", "dense_weights", "zaya_skip"}
