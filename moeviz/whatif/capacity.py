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
from itertools import pairwise
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
# One sort key packs (expert or cell, priority, slot within the group) when their bits fit in it; wider
# inputs take `capacity_ranks`' stable argsort instead (same ranks, slower).
_KEY_BITS = 64
_CHUNK_SLOTS = 1 << 17  # slots plus (group, expert) cells replayed at a time (whole dispatch groups)
_ROW_PADDING = 2  # sort group by group while the padded table holds at most this many × the keys


@dataclass(frozen=True)
class _LayerDrops:
    """One layer replayed at the ladder's ascending distinct CFs. G = groups, E = experts, B = position
    buckets, L = ladder steps; an assignment's drop level is how many ladder CFs drop it (0 … L).

    caps [L, G]: C per group at each step; assigned [E] and dropped [L, E]: valid assignments per expert,
    and those dropped at each step; assigned_bucket [B]; bucket_levels [(L + 1) · B]: dropped assignments by
    (level, position bucket), level 0 left empty; token_levels [L + 2]: tokens by the lowest level among
    their valid slots (L + 1: none)."""

    caps: np.ndarray
    assigned: np.ndarray
    dropped: np.ndarray
    assigned_bucket: np.ndarray
    bucket_levels: np.ndarray
    token_levels: np.ndarray


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


def _priority_key(priority: np.ndarray) -> np.ndarray:
    """float32 priorities [O] → uint32 keys whose ascending order is the priorities' descending order on
    their bits, as `moeviz.scoring.capacity_ranks` orders them (+0.0 before −0.0)."""
    bits = np.ascontiguousarray(priority, dtype=np.float32).view(np.uint32)
    flip = (bits.view(np.int32) >> 31).view(np.uint32)  # all ones for a negative float, else 0
    np.invert(flip, out=flip)
    flip &= np.uint32(0x7FFFFFFF)  # a negative float keeps its bits, a positive one flips all but the sign
    flip ^= bits
    return flip


def _packed_order(
    high: np.ndarray, high_bits: int, priority: np.ndarray | None, local: np.ndarray, local_bits: int
) -> np.ndarray | None:
    """Unique uint64 keys [O] ordered as (high, priority descending, local), or None when they do not fit
    in `_KEY_BITS`; `local` is distinct within one `high`, so any sort of the keys gives the one order."""
    priority_bits = 0
    if priority is not None:
        key_p = _priority_key(priority)
        key_p -= key_p.min(initial=0)  # only the range in use takes bits
        priority_bits = int(key_p.max(initial=0)).bit_length()
    if high_bits + priority_bits + local_bits > _KEY_BITS:
        return None
    key = high.astype(np.uint64)
    key <<= np.uint64(priority_bits)
    if priority_bits:
        key |= key_p
    key <<= np.uint64(local_bits)
    key |= np.asarray(local, dtype=np.int64).view(np.uint64)  # ≥ 0: the same bits
    return key


def _sorted_drops(
    slots: np.ndarray,
    cell: np.ndarray,
    expert: np.ndarray,
    priority: np.ndarray | None,
    experts: int,
    need: np.ndarray,
    cell_count: np.ndarray,
    cell_group: np.ndarray,
    group_size: np.ndarray,
) -> tuple[np.ndarray, np.ndarray] | None:
    """The over-full assignments in the policy's order, (cell, priority descending, arrival), by one sort of
    packed unique keys; None when they do not fit in `_KEY_BITS`. M over-full cells in (group, expert)
    order; slots [O] ascending, with their cell [O], expert [O] and priority [O] (None: arrival order);
    need [L, M]: per ladder step and cell its first dropped rank (need[0] < cell_count [M]); cell_group [M];
    group_size [G]: slots per group. → (slot [D], level [D]) of the assignments dropped at the smallest CF,
    level = how many ladder steps drop it."""
    group_slot = np.cumsum(group_size) - group_size  # each group's first slot
    group_count = np.bincount(cell_group, weights=cell_count, minlength=len(group_size)).astype(np.int64)
    # slots ascend and groups are contiguous in arrival order: slots run group by group
    local = slots - np.repeat(group_slot, group_count)
    local_bits = (int(group_size.max()) - 1).bit_length()
    start = np.cumsum(cell_count) - cell_count  # each cell's first position among the sorted keys
    # One sort per group, each a row of a padded table sorted row by row (shorter sorts), unless uneven
    # groups would pad it to far more than the keys: then one sort of them all, the group in the key.
    rows = np.flatnonzero(group_count)
    width = int(group_count.max(initial=0))
    if len(rows) * width <= _ROW_PADDING * len(slots):
        key = _packed_order(expert, (experts - 1).bit_length(), priority, local, local_bits)
        if key is None:
            return None
        shift = np.zeros(len(group_size), dtype=np.int64)  # a key's index in `key` + shift = its table place
        shift[rows] = np.arange(len(rows)) * width - (np.cumsum(group_count[rows]) - group_count[rows])
        table = np.full(len(rows) * width, np.iinfo(np.uint64).max, dtype=np.uint64)  # pads sort last
        table[np.arange(len(key)) + np.repeat(shift[rows], group_count[rows])] = key
        table.reshape(len(rows), width).sort(axis=1)
        key, start = table, start + shift[cell_group]
    else:
        key = _packed_order(cell, (len(group_size) * experts - 1).bit_length(), priority, local, local_bits)
        if key is None:
            return None
        key.sort()
    # a cell's drops are its ranks need[0] … count − 1, level l on ranks [need[l − 1], need[l]) (need[L] =
    # count): runs, one per cell, laid end to end
    drops = cell_count - need[0]
    first = start + need[0] - (np.cumsum(drops) - drops)
    position = np.repeat(first, drops) + np.arange(int(drops.sum()))
    local = key[position] & np.uint64((1 << local_bits) - 1)
    slot = np.repeat(group_slot[cell_group], drops) + local.astype(np.int64)
    reached = np.minimum(np.vstack([need, cell_count]), cell_count)  # [L + 1, M]
    runs = np.diff(reached, axis=0).T  # [M, L]: ranks at level 1 … L per cell
    level = np.repeat(np.tile(np.arange(1, len(need) + 1, dtype=np.int64), len(cell_count)), runs.reshape(-1))
    return slot, level


def _drop_levels(
    layer: LayerRoutes,
    policy: DropPolicy,
    buckets: int,
    ladder: list[float],
    exact: bool,
    group_tokens: int | None = None,
) -> _LayerDrops:
    """Drop levels of one layer's assignments. A cell that fits at the smallest CF fits at every CF (C
    never shrinks as CF grows), so only over-full cells are ranked: by the policy's order, where rank r
    drops at every CF whose C ≤ r. Position buckets are always within the token's sequence, whatever the
    dispatch group. Groups are independent: they are replayed a few whole groups at a time, so that the
    temporaries stay small (in cache, on pages already mapped)."""
    n, k, experts = layer.tokens, layer.k, int(layer.num_experts)
    steps, levels = len(ladder), len(ladder) + 1
    starts, seq_lengths = _sequences(layer)
    within = np.arange(n) - np.repeat(starts, seq_lengths)
    token_bucket = (within * buckets) // np.repeat(seq_lengths, seq_lengths)  # floor(pos / len × buckets)
    token_group, lengths = _dispatch_groups(layer, group_tokens)
    groups = len(lengths)
    caps = np.array([clamped_capacity(lengths, k, experts, cf, exact) for cf in ladder], dtype=np.int64)
    caps = caps.reshape(steps, groups)
    assigned = np.zeros(experts, dtype=np.int64)
    dropped = np.zeros((steps, experts), dtype=np.int64)
    assigned_bucket = np.zeros(buckets, dtype=np.int64)
    bucket_levels = np.zeros(levels * buckets, dtype=np.int64)
    token_levels = np.zeros(levels + 1, dtype=np.int64)
    first_token = np.r_[0, np.cumsum(lengths)]
    # a group goes with the chunk its first slot and first cell are in: both bound a chunk's temporaries
    chunk_of = (first_token[:-1] * k + np.arange(groups) * experts) // _CHUNK_SLOTS
    edges = np.r_[0, np.flatnonzero(np.diff(chunk_of)) + 1, groups]
    for g0, g1 in pairwise(edges.tolist()):
        if g0 == g1:
            continue
        t0, t1 = int(first_token[g0]), int(first_token[g1])
        routed = layer.experts[t0:t1]
        flat = routed.reshape(-1)
        valid = None if flat.min() >= 0 else flat >= 0  # None: the model dropped no slot here
        cell = (routed + ((token_group[t0:t1] - g0) * experts)[:, None]).reshape(-1)  # meaningless if invalid
        count = np.bincount(cell if valid is None else cell[valid], minlength=(g1 - g0) * experts)
        chunk_caps = caps[:, g0:g1]
        assigned += count.reshape(-1, experts).sum(axis=0)
        for step in range(steps):  # n assignments in a cell drop max(0, n − C) whatever the policy
            dropped[step] += np.maximum(count.reshape(-1, experts) - chunk_caps[step][:, None], 0).sum(axis=0)
        over_cells = np.flatnonzero(count > np.repeat(chunk_caps[0], experts))
        bucket = token_bucket[t0:t1]
        # a token's lowest level over its valid slots: 0 outside the drops, `levels` when it has no valid slot
        every = np.zeros((t1 - t0, k), dtype=np.min_scalar_type(levels))
        if valid is None:
            assigned_bucket += np.bincount(bucket, minlength=buckets) * k
        else:
            every.reshape(-1)[~valid] = levels
            assigned_bucket += np.bincount(np.repeat(bucket, k)[valid], minlength=buckets)
        if len(over_cells):
            slot, level = _chunk_drops(
                layer.weights[t0:t1] if policy == "probs" else None,
                flat,
                cell,
                valid,
                over_cells,
                count[over_cells],
                chunk_caps,
                lengths[g0:g1] * k,
                experts,
            )
            bucket_levels += np.bincount(level * buckets + bucket[slot // k], minlength=levels * buckets)
            every.reshape(-1)[slot] = level
        lowest = every[:, 0].copy()
        for column in range(1, k):
            np.minimum(lowest, every[:, column], out=lowest)
        token_levels += np.bincount(lowest, minlength=levels + 1)
    return _LayerDrops(caps, assigned, dropped, assigned_bucket, bucket_levels, token_levels)


def _chunk_drops(
    weights: np.ndarray | None,
    flat: np.ndarray,
    cell: np.ndarray,
    valid: np.ndarray | None,
    over_cells: np.ndarray,
    cell_count: np.ndarray,
    caps: np.ndarray,
    group_size: np.ndarray,
    experts: int,
) -> tuple[np.ndarray, np.ndarray]:
    """(slot [D], level [D]) of the assignments dropped at the smallest CF in a run of whole groups, slots
    counted from its first. weights [T, k] (None: the ``position`` policy), flat [A] experts, cell [A]
    (group · E + expert, meaningless where `valid` [A] is False; None: all valid); over_cells [M] the cells
    over-full at the smallest CF with their cell_count [M]; caps [L, G]; group_size [G] slots per group."""
    over = np.zeros(len(group_size) * experts, dtype=bool)
    over[over_cells] = True
    in_over = over[cell] if valid is None else over[cell] & valid
    slots = np.flatnonzero(in_over)  # [O] arrival order: the last tie-break
    cell_group = over_cells // experts
    need = caps[:, cell_group]  # [L, M] first dropped rank per step and over-full cell
    priority = None if weights is None else weights.reshape(-1)[slots]
    found = _sorted_drops(
        slots, cell[slots], flat[slots], priority, experts, need, cell_count, cell_group, group_size
    )
    if found is not None:
        return found
    # too wide to pack: ranks in arrival order by the stable argsort
    cid = np.cumsum(over)[cell[slots]] - 1  # the cell's index among the over-full ones
    rank = capacity_ranks(cid, priority)
    level = np.zeros(len(slots), dtype=np.int64)
    for step in range(len(need)):
        level += rank >= need[step][cid]
    kept = level > 0
    return slots[kept], level[kept]


def _above(histogram: np.ndarray, levels: int) -> np.ndarray:
    """histogram [levels · W] of (level, column) → [levels − 1, W]: row j counts entries of level > j."""
    at_least = np.cumsum(histogram.reshape(levels, -1)[::-1], axis=0)[::-1]
    return at_least[1:]


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
        drops = _drop_levels(layer, policy, buckets, ladder, exact, group_tokens)
        experts = int(layer.num_experts)
        assigned, assigned_bucket, per_expert = drops.assigned, drops.assigned_bucket, drops.dropped
        caps = list(drops.caps)
        # dropped at ladder step j ⇔ level > j: reverse cumulative sums of the level histograms
        per_bucket = _above(drops.bucket_levels, levels)
        # a token loses every slot at step j ⇔ the lowest level among its valid slots is > j
        all_dropped = _above(drops.token_levels[:levels], levels)[:, 0]
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
