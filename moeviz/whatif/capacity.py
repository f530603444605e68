"""Capacity-factor replay: which routed slots a fixed expert capacity would have dropped.

Capacity per expert C = ceil((T·k / E)·CF) for the T tokens of one dispatch group: one sequence, or a batch
of N consecutive tokens (sequences packed one after another in (seq, pos) order, the last batch shorter), as
a server that routes a packed batch counts them (`moeviz.scoring.expert_capacity`: Megatron's float order,
or exact). `smallest_cf` finds the smallest CF (on a grid) whose replay drops less than a given share.
Policies (`moeviz.scoring.capacity_ranks`): ``probs`` keeps, per over-full expert, the C assignments with the
largest combination weight (ties → earlier token, then earlier slot); ``position`` keeps the first C arrivals
in token order (within a token, slot order) — Megatron's stated intent. Slots the model itself dropped (-1)
stay dropped and are not replay drops. C is clamped to T·k (`clamped_capacity`): a larger C drops nothing
more, and a huge CF would overflow int64.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np
import pandas as pd

from moeviz.errors import InputError
from moeviz.scoring import capacity_ranks, expert_capacity
from moeviz.whatif.routes import LayerRoutes, Routes

DropPolicy = Literal["probs", "position"]  # which slots an over-full expert keeps (module docstring)
DROP_POLICIES: tuple[DropPolicy, ...] = get_args(DropPolicy)
DEFAULT_CFS = (1.0, 1.25, 1.5, 2.0)
DEFAULT_BUCKETS = 10


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


def _sequences(layer: LayerRoutes) -> tuple[np.ndarray, np.ndarray]:
    """(starts, lengths) of the layer's sequences: runs of one `seq` in its (seq, pos)-sorted rows."""
    n = layer.tokens
    starts = np.flatnonzero(np.r_[True, layer.seq[1:] != layer.seq[:-1]]) if n else np.zeros(0, int)
    return starts, np.diff(np.r_[starts, n])


def _dispatch_groups(layer: LayerRoutes, group_tokens: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(token_group [N], group sizes [G]): one group per sequence (`group_tokens` None), or batches of
    `group_tokens` consecutive rows in (seq, pos) order, the last one shorter."""
    n = layer.tokens
    if group_tokens is None:
        _, lengths = _sequences(layer)
        return np.repeat(np.arange(len(lengths)), lengths), lengths
    token_group = np.arange(n) // group_tokens
    return token_group, np.bincount(token_group, minlength=-(-n // group_tokens)).astype(np.int64)


def clamped_capacity(tokens, k: int, experts: int, cf: float, exact: bool = False):
    """`expert_capacity` of group sizes `tokens` [G] → [G], at most T·k (every slot of the group's T tokens;
    no expert can need more, so nothing above it changes a drop). Any CF ≥ E reaches T·k, so CF is clamped
    to E before the product: a huge CF never overflows int64."""
    capped = expert_capacity(tokens, k, experts, min(float(cf), float(experts)), exact)
    return np.minimum(capped, np.asarray(tokens, dtype=np.int64) * k)


def checked_cfs(cfs: Sequence[float]) -> list[float]:
    """The capacity factors, each a finite number > 0, a repeated one kept once (first-seen order).
    InputError otherwise."""
    values = [float(cf) for cf in cfs]
    if not values:
        raise InputError("give at least one capacity factor")
    bad = [cf for cf in values if not (math.isfinite(cf) and cf > 0)]
    if bad:
        raise InputError(f"a capacity factor must be a finite positive number, got {bad[0]}")
    return list(dict.fromkeys(values))


def _check_group(group_tokens: int | None) -> None:
    if group_tokens is not None and group_tokens < 1:
        raise InputError(f"a dispatch group holds at least one token, got {group_tokens}")


def _group_words(group_tokens: int | None) -> str:
    """The dispatch group in words, for definitions and readouts."""
    if group_tokens is None:
        return "one sequence"
    return f"a batch of {group_tokens:,} consecutive tokens (sequences packed in order)"


def _rank_layer(
    layer: LayerRoutes,
    policy: DropPolicy,
    buckets: int,
    min_cf: float,
    exact: bool,
    group_tokens: int | None = None,
) -> _LayerRanks:
    """Ranks within each (group, expert) cell; a cell that fits even at the smallest CF never drops at any
    CF, so only over-full cells are sorted (rank 0 elsewhere): balanced routing sorts almost nothing.
    Position buckets are always within the token's sequence, whatever the dispatch group."""
    n, k, experts = layer.tokens, layer.k, int(layer.num_experts)
    starts, seq_lengths = _sequences(layer)
    within = np.arange(n) - np.repeat(starts, seq_lengths)
    token_bucket = (within * buckets) // np.repeat(seq_lengths, seq_lengths)  # floor(pos / len × buckets)
    token_group, lengths = _dispatch_groups(layer, group_tokens)
    flat = layer.experts.reshape(-1)
    valid = flat >= 0
    token = np.repeat(np.arange(n), k)[valid]
    expert = flat[valid].astype(np.int64)
    group = token_group[token]
    cell = group * experts + expert
    fits = np.bincount(cell, minlength=len(lengths) * experts) <= np.repeat(
        clamped_capacity(lengths, k, experts, min_cf, exact), experts
    )
    rank = np.zeros(len(cell), dtype=np.int64)
    over = np.flatnonzero(~fits[cell])  # arrival order kept: capacity_ranks' last tie-break
    if len(over):
        weights = layer.weights.reshape(-1)[valid][over] if policy == "probs" else None
        rank[over] = capacity_ranks(cell[over], weights)
    return _LayerRanks(token, expert, group, rank, lengths, token_bucket, n, over)


def _above(histogram: np.ndarray, levels: int) -> np.ndarray:
    """histogram [levels · W] of (level, column) → [levels − 1, W]: row j counts entries of level > j."""
    at_least = np.cumsum(histogram.reshape(levels, -1)[::-1], axis=0)[::-1]
    return at_least[1:]


def _lowest_level(
    token: np.ndarray, over: np.ndarray, level: np.ndarray, tokens: int, levels: int
) -> np.ndarray:
    """[N] the lowest drop level among each token's valid assignments (0 for one outside the over-full
    cells); `levels` for a token without any (it loses nothing). `token` [A] is ascending."""
    every = np.zeros(len(token), dtype=np.int64)
    every[over] = level
    lowest = np.full(tokens, levels, dtype=np.int64)
    if len(token):
        starts = np.flatnonzero(np.r_[True, token[1:] != token[:-1]])
        lowest[token[starts]] = np.minimum.reduceat(every, starts)
    return lowest


@dataclass(frozen=True)
class CapacityResult:
    """Every layer × CF. Frames are built eagerly; see the frame methods for their columns."""

    model: str
    tokens: int
    policy: DropPolicy
    exact: bool
    layers: pd.DataFrame
    experts: pd.DataFrame
    positions: pd.DataFrame
    group_tokens: int | None = None  # None: one dispatch group per sequence

    @property
    def definition(self) -> str:
        order = "exact rational" if self.exact else "Megatron's float order"
        how = {
            "probs": "per over-full expert keep the C largest combination weights (ties → earlier token)",
            "position": "per over-full expert keep the first C arrivals (token order, then slot order)",
        }[self.policy]
        return (
            f"C = ceil((T·k/E)·CF) per dispatch group = {_group_words(self.group_tokens)} (Megatron "
            f"get_capacity, {order}; "
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
        out = {"model": self.model, "tokens": self.tokens, "definition": self.definition, "layers": layers}
        if self.group_tokens is not None:  # a sequence per group (the default) adds no key
            out["group_tokens"] = self.group_tokens
        return out


def replay_capacity(
    routes: Routes,
    cfs: Sequence[float] = DEFAULT_CFS,
    policy: DropPolicy = "probs",
    buckets: int = DEFAULT_BUCKETS,
    exact: bool = False,
    group_tokens: int | None = None,
) -> CapacityResult:
    """Replay every layer's routing under each capacity factor; dispatch group = one sequence, or with
    `group_tokens` a batch of that many consecutive tokens (sequences packed in order)."""
    if policy not in DROP_POLICIES:
        raise InputError(f"unknown drop policy {policy!r}; choose one of {', '.join(DROP_POLICIES)}")
    cfs = checked_cfs(cfs)
    # a bucket per token is the finest curve, more only allocates; the default stands for a short prompt
    most = max(max(layer.tokens for layer in routes.layers), DEFAULT_BUCKETS)
    if not 1 <= buckets <= most:
        raise InputError(
            f"position buckets (--buckets) must be between 1 and {most:,} (the tokens replayed, at least "
            f"{DEFAULT_BUCKETS}), got {buckets:,}"
        )
    _check_group(group_tokens)
    layer_rows, expert_rows = [], []
    pos_assigned = np.zeros((len(cfs), buckets), dtype=np.int64)
    pos_dropped = np.zeros((len(cfs), buckets), dtype=np.int64)
    # Drops are nested: C never shrinks as CF grows, so an assignment dropped at one CF is dropped at every
    # smaller one. Each assignment gets its drop level (how many of the ascending distinct CFs drop it);
    # every per-CF count is then one histogram over levels, read from the top down.
    ladder = sorted(set(float(cf) for cf in cfs))
    step_of = [ladder.index(float(cf)) for cf in cfs]
    levels = len(ladder) + 1
    for layer in routes.layers:
        ranks = _rank_layer(layer, policy, buckets, ladder[0], exact, group_tokens)
        experts = int(layer.num_experts)
        assigned = np.bincount(ranks.expert, minlength=experts)
        assigned_bucket = np.bincount(ranks.token_bucket[ranks.token], minlength=buckets)
        caps = [clamped_capacity(ranks.group_tokens, layer.k, experts, cf, exact) for cf in ladder]
        over = ranks.over  # only these assignments can drop
        o_rank, o_group, o_token = ranks.rank[over], ranks.group[over], ranks.token[over]
        level = np.zeros(len(over), dtype=np.int64)
        for cap in caps:
            level += o_rank >= cap[o_group]
        # dropped at ladder step j ⇔ level > j: reverse cumulative sums of the level histograms
        o_expert = ranks.expert[over]
        per_expert = _above(np.bincount(level * experts + o_expert, minlength=levels * experts), levels)
        per_bucket = _above(
            np.bincount(level * buckets + ranks.token_bucket[o_token], minlength=levels * buckets), levels
        )
        # a token loses every slot at step j ⇔ the lowest level among its valid slots is > j
        lowest = _lowest_level(ranks.token, over, level, ranks.tokens, levels)
        all_dropped = _above(np.bincount(lowest[lowest < levels], minlength=levels), levels)[:, 0]
        total = int(assigned.sum())
        for ci, cf in enumerate(cfs):
            j = step_of[ci]
            dropped_e = per_expert[j].reshape(-1)
            dropped = int(dropped_e.sum())
            cap = caps[j]
            layer_rows.append(
                {
                    "layer": layer.layer,
                    "cf": float(cf),
                    "policy": policy,
                    "capacity": int(cap.max()) if len(cap) else 0,
                    "capacity_min": int(cap.min()) if len(cap) else 0,
                    "assigned": total,
                    "dropped": dropped,
                    "dropped_fraction": float(dropped / total) if total else 0.0,
                    "tokens_all_dropped": int(all_dropped[j]),
                    "overflowing_experts": int(np.count_nonzero(dropped_e)),
                }
            )
            expert_rows.append(
                pd.DataFrame(
                    {
                        "layer": layer.layer,
                        "cf": float(cf),
                        "expert": np.arange(experts),
                        "assigned": assigned,
                        "dropped": dropped_e,
                        "dropped_fraction": dropped_e / np.maximum(assigned, 1),
                    }
                )
            )
            pos_assigned[ci] += assigned_bucket
            pos_dropped[ci] += per_bucket[j].reshape(-1)
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
        group_tokens=group_tokens,
    )


@dataclass(frozen=True)
class SmallestCF:
    """`smallest_cf`'s answer: `cf`, the smallest capacity factor on the grid of `step` whose replay drops
    less than `max_drop` of all assignments (every layer pooled); what it and the grid point below drop."""

    cf: float
    dropped_fraction: float
    below_cf: float | None  # cf − step (None when cf is the first grid point)
    below_dropped_fraction: float | None
    capacity: int  # the largest C over layers and groups at cf
    max_drop: float
    step: float
    group_tokens: int | None
    exact: bool

    @property
    def readout(self) -> str:
        """One line for the screen and the CLI."""
        line = (
            f"The smallest CF (to {self.step:g}) that drops < {self.max_drop:.2%} of the assignments over "
            f"all layers, with a dispatch group of {_group_words(self.group_tokens)}: {self.cf:g} (drops "
            f"{self.dropped_fraction:.3%}, capacity up to {self.capacity:,} slots per expert)"
        )
        if self.below_cf is not None:
            line += f"; CF {self.below_cf:g} drops {self.below_dropped_fraction:.3%}"
        return line + ". Any drop policy drops as many slots: the policy chooses which, not how many."


def _cell_counts(routes: Routes, group_tokens: int | None) -> list[tuple[np.ndarray, np.ndarray, int, int]]:
    """Per layer: (assignments per (group, expert) [G, E], group sizes [G], k, E); slots the model
    dropped are not counted."""
    out = []
    for layer in routes.layers:
        experts = int(layer.num_experts)
        token_group, lengths = _dispatch_groups(layer, group_tokens)
        flat = layer.experts.reshape(-1)
        valid = flat >= 0
        cell = token_group[np.repeat(np.arange(layer.tokens), layer.k)[valid]] * experts + flat[valid]
        counts = np.bincount(cell, minlength=len(lengths) * experts).reshape(len(lengths), experts)
        out.append((counts, lengths, layer.k, experts))
    return out


def _dropped_at(cells, cf: float, exact: bool) -> tuple[int, int, int]:
    """(dropped, assigned, largest capacity) at `cf`: Σ over cells of max(0, assigned − C of its group),
    the count every drop policy drops (`replay_capacity`'s dropped, summed over layers)."""
    dropped = assigned = peak = 0
    for counts, lengths, k, experts in cells:
        caps = clamped_capacity(lengths, k, experts, cf, exact)
        dropped += int(np.maximum(counts - caps[:, None], 0).sum())
        assigned += int(counts.sum())
        peak = max(peak, int(caps.max(initial=0)))
    return dropped, assigned, peak


def smallest_cf(
    routes: Routes,
    max_drop: float,
    *,
    group_tokens: int | None = None,
    exact: bool = False,
    step: float = 0.01,
) -> SmallestCF:
    """The smallest capacity factor i·`step` (i ≥ 1) whose replay drops less than `max_drop` (a fraction,
    0 < max_drop ≤ 1) of the valid assignments over all layers. Drops fall as CF grows (each group's C =
    ceil((T·k/E)·CF) never shrinks), so a binary search over the grid finds it; each probe counts the drops
    exactly as `replay_capacity` does. The grid ends where every cell fits (nothing drops)."""
    if not 0.0 < max_drop <= 1.0:
        raise InputError(f"the drop share must be in (0, 1], got {max_drop}: nothing drops less than 0")
    if not (math.isfinite(step) and step > 0):
        raise InputError(f"the CF step must be a finite number > 0, got {step}")
    _check_group(group_tokens)
    cells = _cell_counts(routes, group_tokens)

    def grid(i: int) -> float:
        return round(i * step, 10)  # prints as the decimal it is: exact rounding reads CF by its repr

    def fraction(i: int) -> float:
        dropped, assigned, _ = _dropped_at(cells, grid(i), exact)
        return dropped / assigned if assigned else 0.0

    # nothing drops once C ≥ the fullest cell of every group: CF ≥ max_e n / (T·k/E); +1 for float order
    need = max(
        (float((counts.max(axis=1) / np.maximum(lengths * k / experts, 1e-12)).max(initial=0.0)))
        for counts, lengths, k, experts in cells
    )
    hi = max(1, int(np.ceil(need / step)) + 1)
    while fraction(hi) >= max_drop:  # never more than once or twice: `need` already fits every cell
        hi *= 2
    lo = 0  # grid point 0 (CF 0) stands for "drops too much"
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fraction(mid) < max_drop:
            hi = mid
        else:
            lo = mid
    dropped, assigned, capacity = _dropped_at(cells, grid(hi), exact)
    return SmallestCF(
        cf=grid(hi),
        dropped_fraction=dropped / assigned if assigned else 0.0,
        below_cf=grid(lo) if lo else None,
        below_dropped_fraction=fraction(lo) if lo else None,
        capacity=capacity,
        max_drop=float(max_drop),
        step=float(step),
        group_tokens=group_tokens,
        exact=exact,
    )
