"""Counterfactual routing specs and the rewrite they compile to.

An intervention acts on the decision the experts module receives (`top_k_index [N, k]`, `top_k_weights
[N, k]`, after every selection rule of the family), so it works the same for biased-selection families.
Rows of a call are tokens flattened row-major from [B, S]; a spec's `positions` are positions within the
sequence (row % S), so in a batch they apply to that position of every sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from moeviz.errors import InterventionError
from moeviz.models.dispatch import unsupported_reason
from moeviz.models.sites import MoESite


def _positions(value: Sequence[int] | int | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, (int, np.integer)):
        return (int(value),)
    return tuple(int(v) for v in value)


@dataclass(frozen=True)
class DisableExpert:
    """Expert `expert` contributes nothing: its combination weight is set to 0 (the slot stays, so the
    other experts' weights are unchanged unless `renormalize`, which rescales them to the token's original
    total). `layer=None`: every MoE layer; `positions=None`: every token."""

    expert: int
    layer: int | None = None
    positions: Sequence[int] | int | None = None
    renormalize: bool = False
    site: str | None = None


@dataclass(frozen=True)
class ForceExpert:
    """Send the token(s) to `expert` in the slot of rank `rank` (0 = the largest weight), keeping that
    slot's weight. If `expert` already holds another slot, the two slots swap experts."""

    expert: int
    layer: int
    positions: Sequence[int] | int | None = None
    rank: int = 0
    site: str | None = None


@dataclass(frozen=True)
class NextBest:
    """Replace the expert in the slot of rank `rank` by the best-scoring expert not already chosen (by
    selection score: router score plus balancing bias; group limits are not re-applied), keeping the
    slot's weight."""

    layer: int
    positions: Sequence[int] | int | None = None
    rank: int = 0
    site: str | None = None


@dataclass(frozen=True)
class ForceRouting:
    """Dispatch exactly `experts [N, k]` with `weights [N, k]` at one layer (N = tokens in the call), e.g.
    a captured routing re-injected. Slots with expert -1 are given weight 0 on expert 0."""

    layer: int
    experts: np.ndarray | torch.Tensor
    weights: np.ndarray | torch.Tensor
    site: str | None = None


@dataclass(frozen=True)
class _DisablePerSequence:
    """Internal (importance sweeps): in sequence b of the batch, disable expert `experts[b]` (-1: none)."""

    layer: int
    experts: tuple[int, ...]
    site: str | None = None


Intervention = DisableExpert | ForceExpert | NextBest | ForceRouting | _DisablePerSequence


def _matches(spec: Intervention, site: MoESite) -> bool:
    layer_ok = spec.layer is None or spec.layer == site.layer
    site_ok = spec.site is None or spec.site == site.site
    return layer_ok and site_ok


def resolve(sites: list[MoESite], interventions: Sequence[Intervention]) -> dict[int, list[Intervention]]:
    """Site index -> the interventions acting there, in order; raises InterventionError on a bad spec."""
    plan: dict[int, list[Intervention]] = {}
    layers = sorted({s.layer for s in sites})
    for spec in interventions:
        targets = [i for i, site in enumerate(sites) if _matches(spec, site)]
        if not targets:
            raise InterventionError(f"{spec!r}: no MoE layer {spec.layer} (MoE layers: {layers})")
        for i in targets:
            site = sites[i]
            reason = unsupported_reason(site)
            if reason is not None:
                raise InterventionError(f"routing interventions are unsupported here: {reason}")
            expert = getattr(spec, "expert", None)
            if expert is not None and not 0 <= expert < site.num_experts:
                raise InterventionError(
                    f"expert {expert} out of range: layer {site.layer} has experts 0..{site.num_experts - 1}"
                )
            rank = getattr(spec, "rank", 0)
            if site.top_k is not None and not 0 <= rank < site.top_k:
                raise InterventionError(
                    f"rank {rank} out of range: layer {site.layer} dispatches top-{site.top_k}"
                )
            plan.setdefault(i, []).append(spec)
    return plan


def _row_mask(spec_positions, n_rows: int, seq_len: int, device) -> torch.Tensor:
    positions = _positions(spec_positions)
    if positions is None:
        return torch.ones(n_rows, dtype=torch.bool, device=device)
    if any(p < 0 or p >= seq_len for p in positions):
        raise InterventionError(f"positions {positions} outside the sequence (0..{seq_len - 1})")
    pos = torch.arange(n_rows, device=device) % seq_len
    return torch.isin(pos, torch.as_tensor(positions, device=device))


def _rank_slots(weights: torch.Tensor) -> torch.Tensor:
    """[N, k] slot index of each rank (rank 0 = largest weight; ties keep slot order)."""
    return torch.argsort(-weights.float(), dim=1, stable=True)


def apply(
    spec: Intervention,
    site: MoESite,
    index: torch.Tensor,
    weights: torch.Tensor,
    logits: torch.Tensor | None,
    seq_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One intervention on one call's decision: index [N, k], weights [N, k] -> new (index, weights)."""
    n, k = index.shape
    if isinstance(spec, ForceRouting):
        experts: torch.Tensor = (
            torch.as_tensor(np.asarray(spec.experts)).reshape(-1, k)
            if not torch.is_tensor(spec.experts)
            else spec.experts
        )
        new_w: torch.Tensor = (
            torch.as_tensor(np.asarray(spec.weights)) if not torch.is_tensor(spec.weights) else spec.weights
        )
        if tuple(experts.shape) != (n, k) or tuple(new_w.shape) != (n, k):
            raise InterventionError(
                f"ForceRouting at layer {site.layer}: expected experts and weights of shape [{n}, {k}] "
                f"(tokens in this call, top-k), got {tuple(experts.shape)} and {tuple(new_w.shape)}"
            )
        experts = experts.to(index.device).long()
        new_w = torch.where(
            experts >= 0, new_w.to(weights.device, weights.dtype), torch.zeros((), dtype=weights.dtype)
        )
        return experts.clamp(min=0), new_w
    if isinstance(spec, _DisablePerSequence):
        per_seq = torch.as_tensor(spec.experts, device=index.device)
        target = per_seq[torch.arange(n, device=index.device) // seq_len]  # [N]
        hit = index == target[:, None]
        return index, torch.where(hit, torch.zeros((), dtype=weights.dtype), weights)
    rows = _row_mask(spec.positions, n, seq_len, index.device)  # [N]
    if isinstance(spec, DisableExpert):
        hit = (index == spec.expert) & rows[:, None]
        new_w = torch.where(hit, torch.zeros((), dtype=weights.dtype), weights)
        if spec.renormalize:
            total, kept = weights.sum(1, keepdim=True), new_w.sum(1, keepdim=True)
            scale = torch.where(kept > 0, total / kept.clamp_min(torch.finfo(weights.dtype).tiny), 1.0)
            new_w = torch.where(hit.any(1, keepdim=True), new_w * scale, new_w)
        return index, new_w
    slot = _rank_slots(weights)[:, spec.rank]  # [N]
    arange = torch.arange(n, device=index.device)
    new_index = index.clone()
    if isinstance(spec, ForceExpert):
        current = index[arange, slot]
        holder = index == spec.expert  # [N, k]: where the forced expert already sits
        swap = holder & rows[:, None]
        new_index = torch.where(swap, current[:, None], new_index)
        new_index[arange[rows], slot[rows]] = spec.expert
        return new_index, weights
    if isinstance(spec, NextBest):
        if logits is None:
            raise InterventionError(f"NextBest at layer {site.layer}: the router's logits were not seen")
        scores = site.router_scores(logits.detach().float(), selection=True)
        scores = scores.scatter(1, index.long(), float("-inf"))
        best = scores.argmax(dim=1).to(index.dtype)
        new_index[arange[rows], slot[rows]] = best[rows]
        return new_index, weights
    raise InterventionError(f"unknown intervention {spec!r}")
