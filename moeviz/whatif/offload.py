"""Expert offloading: per MoE layer a GPU cache of C experts, the rest in CPU RAM, replayed over real routing.

Definitions (docs/deployment-whatifs.md): step s (one token, in decode order within its sequence) needs its
distinct experts R_s resident at once; demand loads only; the victim is never in R_s; cold start per sequence.
hit rate = hits / Σ|R_s|; bytes = misses × expert bytes (cold misses count); stall = bytes / bandwidth (no
overlap: an upper bound). Policies:

- ``lru`` as dvmazur/mixtral-offloading ``src/expert_cache.py``: the step's resident experts are touched first
  (ascending id), then misses load in ascending id, each evicting the least recently used;
- ``lfu``: fewest accesses so far (counts kept after eviction), ties → least recently used → lowest id;
- ``belady``: evict the farthest next use within the sequence (never again = infinitely far), ties → lowest
  id.

Every (layer, sequence) pair is an independent cache, so all of them are simulated at once, and a hit-rate
curve's nearby cache sizes too: the only Python loop runs over the step index within a sequence. Because the
victim is never in R_s and the step's own loads are never evicted, the m misses of a step evict exactly the
m smallest eviction keys among the other residents, whatever order they load in; each policy packs its
tie-breaks into one int64 key (unique within a cache) so a min decides.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np
import pandas as pd

from moeviz.errors import InputError
from moeviz.whatif.routes import Routes

OffloadPolicy = Literal["lru", "lfu", "belady"]  # which resident expert a miss evicts (DEFINITIONS)
POLICIES: tuple[OffloadPolicy, ...] = get_args(OffloadPolicy)
DEFINITIONS = {
    "lru": "LRU as dvmazur/mixtral-offloading src/expert_cache.py (hits touched first in ascending id, "
    "then misses load in ascending id, each evicting the least recently used)",
    "lfu": "LFU (fewest accesses so far, counts kept after eviction; ties → least recently used → lowest id)",
    "belady": "Belady (evict the farthest next use within the sequence; never again = infinitely far; "
    "ties → lowest id)",
}
COMMON = "cold start per sequence; demand loads only; stall = bytes / bandwidth (no overlap: an upper bound)"
_PROTECTED = np.iinfo(np.int64).max  # key of a slot holding an expert of the current step: never evicted
_EMPTY = -1  # key of a free slot: below every real key, so a miss fills free slots before evicting


@dataclass(frozen=True)
class _Prepared:
    """Every layer's sequences as rows of one batch, rows ordered by sequence length (longest first).

    - flat [T, B, k] intp: row·E + expert of step t's distinct experts (ascending id), `dummy` = no expert
    - active [T] int: rows still decoding at step t (rows are sorted, so the active rows are a prefix)
    - row_layer [B] int: index into `layers` of each row
    - requested [B] int: Σ|R_s| of each row
    - steps [L] int: tokens (decode steps) of each layer
    """

    flat: np.ndarray
    active: np.ndarray
    row_layer: np.ndarray
    requested: np.ndarray
    steps: np.ndarray
    experts: int
    k: int
    layers: list[int]
    model: str
    tokens: int

    @property
    def rows(self) -> int:
        return int(self.flat.shape[1])

    @property
    def dummy(self) -> int:
        return self.rows * self.experts


def _sort_rows(values: np.ndarray) -> np.ndarray:
    """[N, k] rows sorted ascending. numpy sorts short rows one call each; for small k a bubble network of
    column-wise min/max is several times faster."""
    if values.shape[1] > 8:
        return np.sort(values, axis=1)
    cols = [values[:, j] for j in range(values.shape[1])]
    for end in range(len(cols) - 1, 0, -1):
        for j in range(end):
            cols[j], cols[j + 1] = np.minimum(cols[j], cols[j + 1]), np.maximum(cols[j], cols[j + 1])
    return np.stack(cols, axis=1)


def _sorted_distinct(experts: np.ndarray, sentinel: int) -> np.ndarray:
    """[N, k] → [N, k]: each token's distinct experts ascending, dropped slots and repeats as `sentinel`."""
    ordered = _sort_rows(np.where(experts < 0, sentinel, experts))
    repeat = np.zeros_like(ordered, dtype=bool)
    repeat[:, 1:] = ordered[:, 1:] == ordered[:, :-1]
    return _sort_rows(np.where(repeat, sentinel, ordered))


def _prepare(routes: Routes) -> _Prepared:
    experts = max(int(r.num_experts) for r in routes.layers)
    k = max(r.k for r in routes.layers)
    pieces = []  # (layer index, sequence start, sequence length, sorted distinct experts of the layer)
    for li, layer in enumerate(routes.layers):
        n = layer.tokens
        if n == 0:
            continue
        starts = np.flatnonzero(np.r_[True, layer.seq[1:] != layer.seq[:-1]])
        lengths = np.diff(np.r_[starts, n])
        distinct = np.full((n, k), experts, dtype=np.int64)
        distinct[:, : layer.k] = _sorted_distinct(layer.experts.astype(np.int64), experts)
        pieces.append((li, starts, lengths, distinct))
    if not pieces:
        raise InputError(f"{routes.model}: no routed token to replay")
    row_layer = np.concatenate([np.full(len(p[1]), p[0]) for p in pieces])
    lengths = np.concatenate([p[2] for p in pieces])
    order = np.argsort(-lengths, kind="stable")  # longest first: active rows form a prefix at every step
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    rows, longest = len(order), int(lengths.max())
    dummy = rows * experts
    flat = np.full((longest, rows, k), dummy, dtype=np.intp)
    requested = np.zeros(rows, dtype=np.int64)
    offset = 0
    for _, starts, lens, distinct in pieces:
        row = rank[offset + np.repeat(np.arange(len(starts)), lens)]
        step = np.arange(len(row)) - np.repeat(starts, lens)
        valid = distinct < experts
        flat[step, row] = np.where(valid, row[:, None] * experts + distinct, dummy)
        requested += np.bincount(row, weights=valid.sum(1), minlength=rows).astype(np.int64)
        offset += len(starts)
    sorted_lengths = lengths[order]
    active = np.searchsorted(-sorted_lengths, -np.arange(longest), side="left")
    steps = np.zeros(len(routes.layers), dtype=np.int64)
    np.add.at(steps, row_layer, lengths)
    return _Prepared(
        flat=flat,
        active=active.astype(np.int64),
        row_layer=row_layer[order],
        requested=requested,
        steps=steps,
        experts=experts,
        k=k,
        layers=[r.layer for r in routes.layers],
        model=routes.model,
        tokens=routes.tokens,
    )


def _next_use(prep: _Prepared) -> np.ndarray:
    """[T, B, k] int32: the step at which this access's expert is next needed in its sequence (T = never)."""
    longest = prep.flat.shape[0]
    seen = np.full(prep.dummy + 1, longest, dtype=np.int32)
    out = np.empty(prep.flat.shape, dtype=np.int32)
    for t in range(longest - 1, -1, -1):  # backwards: `seen` holds each expert's next step after t
        f = prep.flat[t, : prep.active[t]]
        out[t, : prep.active[t]] = seen[f]
        seen[f] = t
    return out


def _simulate(prep: _Prepared, caches: Sequence[int], policy: OffloadPolicy) -> tuple[np.ndarray, np.ndarray]:
    """(misses [G, B] per row, misses [G, T] per step summed over rows) at each of the G cache sizes.

    The G caches are replayed together: prepared row b at cache g is row r = b·G + g, so the rows still
    decoding at a step stay a prefix. State is slot-major so every per-step reduction runs over the long row
    axis: slot_key [S + 1, R] holds key·S + slot (the min is the victim, its slot = min mod S), free slots
    −S..−1 (filled before any eviction), slots past the row's cache size _PROTECTED (never free nor a
    victim). The last slot is a sink for the writes of dropped slots and of misses before they have a slot,
    so no write needs a mask. slot_of maps (row, expert) = r·E + e to its slot or −1, and a dropped slot to
    the sink; slot_expert [S + 1, R] maps back. A step's m misses in a row evict the row's m smallest keys.
    """
    experts, k, longest = prep.experts, prep.k, prep.flat.shape[0]
    width = len(caches)
    rows = prep.rows * width
    dropped = rows * experts  # + g·E: a dropped slot at cache g
    free = dropped + width * experts  # slot_expert of a free slot
    capacity = np.minimum(np.asarray(caches, dtype=np.int64), experts)  # more slots than experts never fill
    slots = int(capacity.max())
    slot_of = np.full(free + 1, -1, dtype=np.intp)
    slot_of[dropped:free] = slots
    slot_expert = np.full((slots + 1, rows), free, dtype=np.intp)
    slot_key = np.repeat(np.arange(-slots, 1, dtype=np.int64)[:, None], rows, axis=1)
    slot_key[np.arange(slots + 1)[:, None] >= np.tile(capacity, prep.rows)[None, :]] = _PROTECTED
    keys_flat, expert_flat = slot_key.reshape(-1), slot_expert.reshape(-1)
    counts = np.zeros(free + 1, dtype=np.int64) if policy == "lfu" else None
    nxt = _next_use(prep) if policy == "belady" else None
    lru_span = (longest + 1) * 2 * k  # room for every recency key below it: packs (count, recency) for LFU
    flat = prep.flat  # row b's expert e at cache g: (b·G + g)·E + e, so b·G·E + e, then g·E per cache
    if width > 1:
        flat = np.where(flat == prep.dummy, dropped, flat // experts * width * experts + flat % experts)
    shift = (np.arange(width) * experts)[None, :, None]
    row_misses = np.zeros(rows, dtype=np.int64)
    step_misses = np.zeros((width, longest), dtype=np.int64)
    col = np.arange(k)
    for t in range(longest):
        na = int(prep.active[t])
        active = na * width
        f = flat[t, :na] if width == 1 else (flat[t, :na, None, :] + shift).reshape(active, k)
        row = np.arange(active)[:, None]
        slot = slot_of[f]
        miss = slot < 0
        missed = miss[:, 0].astype(np.int64)
        for j in range(1, k):  # column by column: reductions over a short last axis are slow in numpy
            missed += miss[:, j]
        row_misses[:active] += missed
        step_misses[:, t] = missed.reshape(na, width).sum(0)
        keys_flat[slot * rows + row] = _PROTECTED  # the step's hits are never victims (a miss's −1: the sink)
        for j in range(k):  # the misses of column j, ascending id, each take the smallest key left
            who = np.flatnonzero(miss[:, j])
            if len(who) == 0:
                continue
            if 8 * len(who) >= active:  # many rows: one reduction beats copying their keys out
                smallest = slot_key[:slots, :active].min(0)[who]
            else:
                smallest = slot_key[:slots, who].min(0)
            victim = smallest % slots
            at = victim * rows + who
            keys_flat[at] = _PROTECTED  # taken (its new key comes at the end of the step)
            slot_of[expert_flat[at]] = -1
            expert_flat[at] = f[who, j]
            slot_of[f[who, j]] = victim
            slot[who, j] = victim
        new = _keys(policy, t, f, miss, col, k, lru_span, counts, experts, longest, nxt, na, width)
        keys_flat[slot * rows + row] = new * slots + slot
    return row_misses.reshape(prep.rows, width).T, step_misses


def _keys(
    policy: OffloadPolicy,
    t: int,
    f: np.ndarray,
    miss: np.ndarray,
    col: np.ndarray,
    k: int,
    lru_span: int,
    counts: np.ndarray | None,
    experts: int,
    longest: int,
    nxt: np.ndarray | None,
    na: int,
    width: int,
) -> np.ndarray:
    """[na·width, k] int64 eviction keys after step t's accesses (each of the na rows once per cache size);
    the smallest key is evicted first."""
    if policy == "belady":
        assert nxt is not None  # the caller computes next uses for belady
        # farthest next use first, never again (= longest) before all, ties → lowest id
        farthest = longest - nxt[t, :na].astype(np.int64)
        if width > 1:
            farthest = np.repeat(farthest, width, axis=0)
        return farthest * experts + f % experts
    # recency: step t, hits (ascending id) before misses (ascending id), as mixtral-offloading touches them
    recency = t * 2 * k + miss * k + col
    if policy == "lru":
        return recency
    assert counts is not None  # the caller counts uses for lfu
    counts[f] += 1  # f holds distinct experts per row (repeats only at the dummy), so no np.add.at needed
    return counts[f] * lru_span + recency


@dataclass(frozen=True)
class OffloadResult:
    """One policy at one cache size, every MoE layer. Arrays are per layer [L] unless said otherwise.

    step_misses [T]: misses at each decode step (step index within its sequence), over all sequences and
    layers.
    """

    model: str
    tokens: int
    policy: OffloadPolicy
    cache: int
    expert_bytes: int
    bandwidth_gbps: float
    step_time_s: float | None
    layers: list[int]
    steps: np.ndarray
    requested: np.ndarray
    misses: np.ndarray
    step_misses: np.ndarray

    @property
    def definition(self) -> str:
        timing = (
            "" if self.step_time_s is None else f"; tokens/s bound adds {self.step_time_s:g} s compute/step"
        )
        return f"{DEFINITIONS[self.policy]}; {COMMON}{timing}"

    @property
    def hits(self) -> np.ndarray:
        return self.requested - self.misses

    @property
    def hit_rate(self) -> float:
        """Over all layers: Σ hits / Σ |R_s|."""
        total = int(self.requested.sum())
        return float(self.hits.sum() / total) if total else float("nan")

    @property
    def stall_s(self) -> np.ndarray:
        return self.misses * self.expert_bytes / (self.bandwidth_gbps * 1e9)

    def _time_s(self) -> np.ndarray:
        return self.stall_s + (0.0 if self.step_time_s is None else self.steps * self.step_time_s)

    @property
    def tokens_per_s_bound(self) -> float:
        """Layers run in sequence: tokens / (total stall over layers [+ compute])."""
        total = float(self._time_s().sum())
        return self.tokens / total if total > 0 else float("inf")

    def layers_frame(self) -> pd.DataFrame:
        requested = np.maximum(self.requested, 1)
        time_s = self._time_s()
        with np.errstate(divide="ignore"):
            bound = np.where(time_s > 0, self.steps / np.where(time_s > 0, time_s, 1.0), np.inf)
        return pd.DataFrame(
            {
                "layer": self.layers,
                "policy": self.policy,
                "cache": self.cache,
                "hits": self.hits,
                "misses": self.misses,
                "hit_rate": np.where(self.requested > 0, self.hits / requested, np.nan),
                "bytes": self.misses * self.expert_bytes,
                "stall_s": self.stall_s,
                "tokens_per_s_bound": bound,
            }
        )

    def steps_frame(self) -> pd.DataFrame:
        return pd.DataFrame(
            {
                "step": np.arange(len(self.step_misses)),
                "cumulative_bytes": np.cumsum(self.step_misses) * self.expert_bytes,
            }
        )

    def to_json(self) -> dict:
        frame = self.layers_frame()
        layers = [
            {
                "layer": int(row.layer),
                "policy": self.policy,
                "cache": self.cache,
                "hits": int(row.hits),
                "misses": int(row.misses),
                "hit_rate": float(row.hit_rate),
                "bytes": int(row.bytes),
            }
            for row in frame.itertuples()
        ]
        return {"model": self.model, "tokens": self.tokens, "definition": self.definition, "layers": layers}


def _check(prep: _Prepared, cache: int, policy: OffloadPolicy) -> None:
    if policy not in POLICIES:
        raise InputError(f"unknown offload policy {policy!r}; choose one of {', '.join(POLICIES)}")
    if cache < prep.k:
        raise InputError(
            f"a cache of {cache} experts cannot hold one token's {prep.k} experts at once; "
            f"use a cache ≥ {prep.k}"
        )


_GROUP_SPAN = 4  # sizes up to 4× a group's smallest replayed together (2× or all at once: slower)
_GROUP_CELLS = 1 << 24  # (rows × cache sizes) × experts replayed at once: bounds the state's memory


def _results(prep: _Prepared, caches: Sequence[int], policy: OffloadPolicy, **costs) -> list[OffloadResult]:
    """One result per cache size, in the order of `caches`. Nearby cache sizes are replayed together, which
    shares the per-step work of numpy calls; not all at once, since a row's slots past its size stay idle
    but are still scanned (8 beside 256: 32× the slots)."""
    for cache in caches:
        _check(prep, cache, policy)
    ordered = sorted(set(caches))
    most = max(1, _GROUP_CELLS // (prep.rows * prep.experts))
    groups: list[list[int]] = []
    for cache in ordered:
        if groups and cache <= _GROUP_SPAN * groups[-1][0] and len(groups[-1]) < most:
            groups[-1].append(cache)
        else:
            groups.append([cache])
    count = len(prep.layers)
    requested = np.bincount(prep.row_layer, weights=prep.requested, minlength=count).astype(np.int64)
    done = {}
    for group in groups:
        row_misses, step_misses = _simulate(prep, group, policy)
        for cache, misses, steps in zip(group, row_misses, step_misses, strict=True):
            done[cache] = OffloadResult(
                model=prep.model,
                tokens=prep.tokens,
                policy=policy,
                cache=cache,
                layers=prep.layers,
                steps=prep.steps,
                requested=requested,
                misses=np.bincount(prep.row_layer, weights=misses, minlength=count).astype(np.int64),
                step_misses=steps,
                **costs,
            )
    return [done[cache] for cache in caches]


def simulate_offload(
    routes: Routes,
    cache: int,
    policy: OffloadPolicy,
    expert_bytes: int,
    bandwidth_gbps: float = 16.0,
    step_time_s: float | None = None,
) -> OffloadResult:
    """Replay every layer's routing through a cache of `cache` experts per layer under `policy`.

    Each sequence is decoded on its own (cold start); all layers and sequences are simulated at
    once. `step_time_s` (optional) is compute time per decode step per layer, added to the stall for the
    tokens/s bound."""
    (result,) = simulate_offload_policies(routes, cache, (policy,), expert_bytes, bandwidth_gbps, step_time_s)
    return result


def simulate_offload_policies(
    routes: Routes,
    cache: int,
    policies: Sequence[OffloadPolicy] = POLICIES,
    expert_bytes: int = 1,
    bandwidth_gbps: float = 16.0,
    step_time_s: float | None = None,
) -> list[OffloadResult]:
    """`simulate_offload` for several policies at once: the routes are laid out for replay only once."""
    if not (math.isfinite(bandwidth_gbps) and bandwidth_gbps > 0):  # NaN passes a `<= 0` check
        raise InputError(f"bandwidth (--bandwidth) must be a finite number > 0 GB/s, got {bandwidth_gbps}")
    if step_time_s is not None and not (math.isfinite(step_time_s) and step_time_s >= 0):
        raise InputError(f"step time (--step-time) must be a finite number ≥ 0 s, got {step_time_s}")
    prep = _prepare(routes)
    for policy in policies:
        _check(prep, cache, policy)
    costs = {
        "expert_bytes": int(expert_bytes),
        "bandwidth_gbps": float(bandwidth_gbps),
        "step_time_s": step_time_s,
    }
    return [_results(prep, [cache], policy, **costs)[0] for policy in policies]


def hit_rate_curve(
    routes: Routes,
    caches: Sequence[int],
    policies: Sequence[OffloadPolicy] = POLICIES,
    expert_bytes: int | None = None,
) -> pd.DataFrame:
    """Hit rate against cache size per policy. Columns: policy, cache, hit_rate (Σ hits / Σ |R_s| over all
    layers), layer_mean_hit_rate, misses, and bytes (misses × `expert_bytes`) when `expert_bytes` is given:
    without it there is no bytes column (a default of 1 byte once filled it with the miss count)."""
    prep = _prepare(routes)
    rows = []
    for policy in policies:
        results = _results(
            prep,
            [int(c) for c in caches],
            policy,
            expert_bytes=int(expert_bytes or 0),
            bandwidth_gbps=16.0,
            step_time_s=None,
        )
        for cache, result in zip(caches, results, strict=True):
            per_layer = result.layers_frame()["hit_rate"]
            misses = int(result.misses.sum())
            rows.append(
                {
                    "policy": policy,
                    "cache": int(cache),
                    "hit_rate": result.hit_rate,
                    "layer_mean_hit_rate": float(per_layer.mean()),
                    "misses": misses,
                    **({} if expert_bytes is None else {"bytes": misses * int(expert_bytes)}),
                }
            )
    return pd.DataFrame(rows)
