"""Capacity-factor replay: which routed slots a fixed expert capacity would have dropped.

Capacity per expert C = ceil((T·k / E)·CF) for the T tokens of one dispatch group, here one sequence
(`moeviz.scoring.expert_capacity`: Megatron's float order, or exact).
Policies (`moeviz.scoring.capacity_ranks`): ``probs`` keeps, per over-full expert, the C assignments with the
largest combination weight (ties → earlier token, then earlier slot); ``position`` keeps the first C arrivals
in token order (within a token, slot order) — Megatron's stated intent. Slots the model itself dropped (-1)
stay dropped and are not replay drops.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from moeviz.errors import InputError
from moeviz.scoring import capacity_ranks, expert_capacity
from moeviz.whatif.routes import LayerRoutes, Routes

DROP_POLICIES = ("probs", "position")
DEFAULT_CFS = (1.0, 1.25, 1.5, 2.0)


@dataclass(frozen=True)
class _LayerRanks:
    """One layer's valid assignments, flattened in (token, slot) order. A = assignments, G = groups.

    token [A], expert [A], group [A]; rank [A]: arrival rank within its (group, expert) under the policy;
    group_tokens [G]; token_bucket [N]; over [O]: the assignments in cells over-full at the smallest CF (only
    they can drop)."""

    token: np.ndarray
    expert: np.ndarray
    group: np.ndarray
    rank: np.ndarray
    group_tokens: np.ndarray
    token_bucket: np.ndarray
    tokens: int
    over: np.ndarray


def _rank_layer(layer: LayerRoutes, policy: str, buckets: int, min_cf: float, exact: bool) -> _LayerRanks:
    """Ranks within each (group, expert) cell; a cell that fits even at the smallest CF never drops at any
    CF, so only over-full cells are sorted (rank 0 elsewhere): balanced routing sorts almost nothing."""
    n, k, experts = layer.tokens, layer.k, int(layer.num_experts)
    starts = np.flatnonzero(np.r_[True, layer.seq[1:] != layer.seq[:-1]]) if n else np.zeros(0, int)
    lengths = np.diff(np.r_[starts, n])
    token_group = np.repeat(np.arange(len(starts)), lengths)
    within = np.arange(n) - np.repeat(starts, lengths)
    token_bucket = (within * buckets) // np.repeat(lengths, lengths)  # floor(pos / len × buckets)
    flat = layer.experts.reshape(-1)
    valid = flat >= 0
    token = np.repeat(np.arange(n), k)[valid]
    expert = flat[valid].astype(np.int64)
    group = token_group[token]
    cell = group * experts + expert
    fits = np.bincount(cell, minlength=len(lengths) * experts) <= np.repeat(
        expert_capacity(lengths, k, experts, min_cf, exact), experts
    )
    rank = np.zeros(len(cell), dtype=np.int64)
    over = np.flatnonzero(~fits[cell])  # arrival order kept: capacity_ranks' last tie-break
    if len(over):
        weights = layer.weights.reshape(-1)[valid][over] if policy == "probs" else None
        rank[over] = capacity_ranks(cell[over], weights)
    return _LayerRanks(token, expert, group, rank, lengths, token_bucket, n, over)


@dataclass(frozen=True)
class CapacityResult:
    """Every layer × CF. Frames are built eagerly; see the frame methods for their columns."""

    model: str
    tokens: int
    policy: str
    exact: bool
    layers: pd.DataFrame
    experts: pd.DataFrame
    positions: pd.DataFrame

    @property
    def definition(self) -> str:
        order = "exact rational" if self.exact else "Megatron's float order"
        how = {
            "probs": "per over-full expert keep the C largest combination weights (ties → earlier token)",
            "position": "per over-full expert keep the first C arrivals (token order, then slot order)",
        }[self.policy]
        return (
            f"C = ceil((T·k/E)·CF) per dispatch group = one sequence (Megatron get_capacity, {order}; "
            f"capacity shown = max over groups); {how}; slots the model dropped are not counted"
        )

    def layers_frame(self) -> pd.DataFrame:
        """layer, cf, policy, capacity (max over groups), capacity_min, assigned, dropped, dropped_fraction,
        tokens_all_dropped, overflowing_experts (how many experts dropped anything)."""
        return self.layers.copy()

    def experts_frame(self) -> pd.DataFrame:
        """layer, cf, expert, assigned, dropped, dropped_fraction."""
        return self.experts.copy()

    def position_frame(self) -> pd.DataFrame:
        """cf, bucket, bucket_start, bucket_end (fractions of the sequence), assigned, dropped, drop_rate."""
        return self.positions.copy()

    def to_json(self) -> dict:
        layers = [
            {
                "layer": int(row.layer),
                "cf": float(row.cf),
                "policy": self.policy,
                "capacity": int(row.capacity),
                "dropped_fraction": float(row.dropped_fraction),
            }
            for row in self.layers.itertuples()
        ]
        return {"model": self.model, "tokens": self.tokens, "definition": self.definition, "layers": layers}


def replay_capacity(
    routes: Routes,
    cfs: Sequence[float] = DEFAULT_CFS,
    policy: str = "probs",
    buckets: int = 10,
    exact: bool = False,
) -> CapacityResult:
    """Replay every layer's routing under each capacity factor; dispatch group = one sequence."""
    if policy not in DROP_POLICIES:
        raise InputError(f"unknown drop policy {policy!r}; choose one of {', '.join(DROP_POLICIES)}")
    if not cfs or any(not cf > 0 for cf in cfs):
        raise InputError(f"capacity factors must be positive, got {list(cfs)}")
    if buckets < 1:
        raise InputError(f"position buckets must be ≥ 1, got {buckets}")
    layer_rows, expert_rows = [], []
    pos_assigned = np.zeros((len(cfs), buckets), dtype=np.int64)
    pos_dropped = np.zeros((len(cfs), buckets), dtype=np.int64)
    for layer in routes.layers:
        ranks = _rank_layer(layer, policy, buckets, min(cfs), exact)
        experts = int(layer.num_experts)
        assigned = np.bincount(ranks.expert, minlength=experts)
        assigned_bucket = np.bincount(ranks.token_bucket[ranks.token], minlength=buckets)
        slots_per_token = np.bincount(ranks.token, minlength=ranks.tokens)
        over = ranks.over  # every per-CF step below runs on these assignments only
        o_rank, o_group, o_token = ranks.rank[over], ranks.group[over], ranks.token[over]
        o_expert, o_bucket = ranks.expert[over], ranks.token_bucket[o_token]
        for ci, cf in enumerate(cfs):
            caps = expert_capacity(ranks.group_tokens, layer.k, experts, cf, exact)
            dropped = o_rank >= caps[o_group]
            per_expert = np.bincount(o_expert[dropped], minlength=experts)
            lost = o_token[dropped]  # ascending (arrival order): count each token's run of drops
            starts = np.flatnonzero(np.r_[True, lost[1:] != lost[:-1]]) if len(lost) else lost
            runs = np.diff(np.r_[starts, len(lost)])
            total = int(assigned.sum())
            layer_rows.append(
                {
                    "layer": layer.layer,
                    "cf": float(cf),
                    "policy": policy,
                    "capacity": int(caps.max()) if len(caps) else 0,
                    "capacity_min": int(caps.min()) if len(caps) else 0,
                    "assigned": total,
                    "dropped": int(dropped.sum()),
                    "dropped_fraction": float(dropped.sum() / total) if total else 0.0,
                    "tokens_all_dropped": int(np.count_nonzero(runs == slots_per_token[lost[starts]])),
                    "overflowing_experts": int(np.count_nonzero(per_expert)),
                }
            )
            expert_rows.append(
                pd.DataFrame(
                    {
                        "layer": layer.layer,
                        "cf": float(cf),
                        "expert": np.arange(experts),
                        "assigned": assigned,
                        "dropped": per_expert,
                        "dropped_fraction": per_expert / np.maximum(assigned, 1),
                    }
                )
            )
            pos_assigned[ci] += assigned_bucket
            pos_dropped[ci] += np.bincount(o_bucket[dropped], minlength=buckets)
    edges = np.arange(buckets + 1) / buckets
    positions = pd.DataFrame(
        {
            "cf": np.repeat(np.asarray(cfs, dtype=float), buckets),
            "bucket": np.tile(np.arange(buckets), len(cfs)),
            "bucket_start": np.tile(edges[:-1], len(cfs)),
            "bucket_end": np.tile(edges[1:], len(cfs)),
            "assigned": pos_assigned.reshape(-1),
            "dropped": pos_dropped.reshape(-1),
            "drop_rate": pos_dropped.reshape(-1) / np.maximum(pos_assigned.reshape(-1), 1),
        }
    )
    return CapacityResult(
        model=routes.model,
        tokens=routes.tokens,
        policy=policy,
        exact=exact,
        layers=pd.DataFrame(layer_rows),
        experts=pd.concat(expert_rows, ignore_index=True),
        positions=positions,
    )
