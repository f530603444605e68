"""Temporal and cross-layer structure of routing (definitions: docs/routing-metrics.md).

- consecutive-token repetition (Mixtral, arXiv 2401.04088 Table 5): P(top-1 at t = top-1 at t+1) and
  P(S_t ∩ S_{t+1} ≠ ∅) over consecutive tokens of one sequence and stream;
- co-activation (OLMoE, arXiv 2409.02060): CoAct(i, j) = #{t : i, j ∈ S_t} / #{t : i ∈ S_t};
- cross-layer transitions T_ℓ(i → j) = P(j ∈ S^{ℓ+1}_t | i ∈ S^ℓ_t) and top-1 expert paths.

Conventions used throughout moeviz.analysis:
- S_t is the set of experts actually dispatched (slots dropped by capacity, -1, belong to no expert);
- "top-1" is rank 0 of `LayerRouting.experts`, the dispatched expert with the largest combination weight
  (dropped slots sort last, so a token whose first choice was dropped has its next dispatched choice as
  top-1; a token with every slot dropped has top-1 = -1 and takes no part in top-1 statistics);
- tokens are matched across layers (and traces) by their row in `Trace.tokens`.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from math import comb

import numpy as np
import pandas as pd

from moeviz.analysis.balance import expert_counts
from moeviz.trace import LayerRouting, Trace

# Exact load-aware overlap baseline enumerates pairs of distinct dispatched sets: U² work.
_MAX_EXACT_SETS = 2048
_BASELINE_SAMPLES = 200_000


# ---- shared helpers (also used by specialisation.py and compare.py) --------------------------------------
def dispatch_mask(experts: np.ndarray, num_experts: int) -> np.ndarray:
    """[N, E] bool: mask[t, e] = e ∈ S_t, from dispatched ids `experts` [N, k] (-1 = dropped)."""
    mask = np.zeros((len(experts), num_experts), dtype=bool)
    rows, slots = np.nonzero(experts >= 0)
    mask[rows, experts[rows, slots]] = True
    return mask


def next_token_rows(tokens: pd.DataFrame) -> np.ndarray:
    """[T] row in `tokens` of the next token of the same sequence and stream (pos + 1), -1 where none.

    Padding is never in the token table, so a gap in `pos` (or the end of a sequence) ends the chain."""
    if len(tokens) == 0:
        return np.zeros(0, dtype=np.int64)
    stream = pd.factorize(tokens["stream"])[0]
    seq = tokens["seq"].to_numpy()
    pos = tokens["pos"].to_numpy()
    order = np.lexsort((pos, seq, stream))
    s, q, p = stream[order], seq[order], pos[order]
    follows = (s[1:] == s[:-1]) & (q[1:] == q[:-1]) & (p[1:] == p[:-1] + 1)
    nxt = np.full(len(tokens), -1, dtype=np.int64)
    nxt[order[:-1][follows]] = order[1:][follows]
    return nxt


def row_index(token_rows: np.ndarray, num_rows: int) -> np.ndarray:
    """[num_rows] inverse of `token_rows`: index of each token-table row in the layer, -1 if absent."""
    inverse = np.full(num_rows, -1, dtype=np.int64)
    inverse[token_rows] = np.arange(len(token_rows))
    return inverse


def shared_rows(rows_a: np.ndarray, rows_b: np.ndarray, num_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(ia [M], ib [M]): indices into layers a and b of the M tokens both routed, in a's order.

    `rows_a`, `rows_b` are the layers' token rows in the same token table of `num_rows` rows."""
    idx = row_index(rows_b, num_rows)[rows_a]
    keep = np.nonzero(idx >= 0)[0]
    return keep, idx[keep]


def conditional(joint: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """joint [R, C] / counts [R] per row, NaN (no warning) for rows with counts 0."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return joint / counts[:, None]


def consecutive_pairs(routing: LayerRouting, next_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Indices (a [P], b [P]) into the layer's rows such that b is the token right after a (same sequence
    and stream) and both were routed by this layer. `next_rows` from `next_token_rows(trace.tokens)`."""
    inverse = row_index(routing.token_rows, len(next_rows))
    following = next_rows[routing.token_rows]
    b = np.where(following >= 0, inverse[np.maximum(following, 0)], -1)
    a = np.nonzero(b >= 0)[0]
    return a, b[a]


def _site_chains(trace: Trace) -> dict[str, list[LayerRouting]]:
    """MoE layers grouped by site, each list in layer order."""
    chains: dict[str, list[LayerRouting]] = {}
    for routing in trace.layers:
        chains.setdefault(routing.site, []).append(routing)
    return {site: sorted(layers, key=lambda r: r.layer) for site, layers in chains.items()}


# ---- consecutive-token repetition ------------------------------------------------------------------------
def uniform_repetition_baselines(num_experts: int, k: int) -> tuple[float, float]:
    """Chance levels under uniform random top-k routing: (1/E, 1 − C(E−k, k)/C(E, k)).

    For E=8, k=2: (0.125, 1 − 15/28 ≈ 0.4643), Mixtral's 12.5% and ≈46%."""
    return 1.0 / num_experts, 1.0 - comb(num_experts - k, k) / comb(num_experts, k)


def _load_top1_baseline(top1: np.ndarray, num_experts: int) -> float:
    """P(top-1 equal) for two distinct tokens drawn at random from the layer (= expected repetition when
    the layer's routing rows are shuffled across tokens): (Σ c_e² − n) / (n (n − 1))."""
    valid = top1[top1 >= 0]
    n = len(valid)
    if n < 2:
        return float("nan")
    counts = np.bincount(valid, minlength=num_experts).astype(np.float64)
    return float(((counts**2).sum() - n) / (n * (n - 1)))


def _load_overlap_baseline(mask: np.ndarray, seed: int) -> tuple[float, str]:
    """P(S_t ∩ S_u ≠ ∅) for two distinct tokens of the layer drawn at random: exact over the distinct
    dispatched sets when there are few, else estimated from random distinct pairs."""
    n = len(mask)
    if n < 2:
        return float("nan"), "exact"
    packed = np.ascontiguousarray(np.packbits(mask, axis=1))
    keys = packed.view(np.dtype((np.void, packed.shape[1]))).ravel()
    _, first, counts = np.unique(keys, return_index=True, return_counts=True)
    if len(first) <= _MAX_EXACT_SETS:
        sets = mask[first].astype(np.float64)
        overlap = (sets @ sets.T) > 0
        w = counts.astype(np.float64)
        ordered = w @ overlap @ w - (w * np.diag(overlap)).sum()  # drop each token paired with itself
        return float(ordered / (n * (n - 1))), "exact"
    rng = np.random.default_rng(seed)
    i = rng.integers(0, n, _BASELINE_SAMPLES)
    j = (i + rng.integers(1, n, _BASELINE_SAMPLES)) % n  # uniform over u ≠ t
    return float((mask[i] & mask[j]).any(axis=1).mean()), "sampled"


def _repeats(top1: np.ndarray, mask: np.ndarray, a: np.ndarray, b: np.ndarray) -> tuple[float, float, int]:
    both = (top1[a] >= 0) & (top1[b] >= 0)
    same = (top1[a] == top1[b]) & both
    n1 = int(both.sum())
    top1_rate = float(same.sum() / n1) if n1 else float("nan")
    overlap = float((mask[a] & mask[b]).any(axis=1).mean()) if len(a) else float("nan")
    return top1_rate, overlap, n1


def repetition_frame(trace: Trace, shuffles: int = 0, seed: int = 0) -> pd.DataFrame:
    """Consecutive-token repetition per MoE layer, with three baselines.

    Columns: layer, site, pairs (consecutive pairs routed by the layer), top1_pairs (pairs where both
    tokens have a dispatched expert), top1_repeat = P(top-1_t = top-1_{t+1}), overlap_repeat =
    P(S_t ∩ S_{t+1} ≠ ∅); baselines:
    - top1_uniform = 1/E and overlap_uniform = 1 − C(E−k, k)/C(E, k): uniform random routing (closed forms);
    - top1_load, overlap_load: the same quantities for two distinct tokens of this layer drawn at random,
      i.e. the expected value once the layer's routing rows are shuffled across tokens. A skewed load
      raises chance repetition, so compare against these; overlap_load_method says "exact" or "sampled";
    - with `shuffles` > 0, the routing rows are also really shuffled across the layer's tokens that many
      times (seeded): top1_shuffle_mean/std and overlap_shuffle_mean/std give the noise band.
    """
    next_rows = next_token_rows(trace.tokens)
    rng = np.random.default_rng(seed)
    rows = []
    for routing in trace.layers:
        e, k = routing.num_experts, routing.k
        top1 = routing.experts[:, 0]
        mask = dispatch_mask(routing.experts, e)
        a, b = consecutive_pairs(routing, next_rows)
        top1_rate, overlap, n1 = _repeats(top1, mask, a, b)
        u1, uo = uniform_repetition_baselines(e, k)
        load_overlap, method = _load_overlap_baseline(mask, seed)
        row = {
            "layer": routing.layer,
            "site": routing.site,
            "pairs": len(a),
            "top1_pairs": n1,
            "top1_repeat": top1_rate,
            "overlap_repeat": overlap,
            "top1_uniform": u1,
            "overlap_uniform": uo,
            "top1_load": _load_top1_baseline(top1, e),
            "overlap_load": load_overlap,
            "overlap_load_method": method,
        }
        if shuffles > 0:
            null = np.array(
                [
                    _repeats(top1[perm], mask[perm], a, b)[:2]
                    for perm in (rng.permutation(len(top1)) for _ in range(shuffles))
                ]
            )
            row |= {
                "top1_shuffle_mean": float(np.nanmean(null[:, 0])),
                "top1_shuffle_std": float(np.nanstd(null[:, 0])),
                "overlap_shuffle_mean": float(np.nanmean(null[:, 1])),
                "overlap_shuffle_std": float(np.nanstd(null[:, 1])),
            }
        rows.append(row)
    return pd.DataFrame(rows)


# ---- co-activation ---------------------------------------------------------------------------------------
def coactivation_counts(routing: LayerRouting, adjacent_only: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(pair counts [E, E], expert counts [E]).

    All pairs (default): pair[i, j] = #{t : i, j ∈ S_t}, so pair[i, i] = count[i] = #{t : i ∈ S_t}.
    adjacent_only: as the public OLMoE script (scripts/run_moe_analysis.py) counts, only pairs of experts
    in neighbouring ranks of the sorted top-k (slots r, r+1, both directions); the diagonal is then set to
    count[i] so that CoAct(i, i) = 1 in both variants."""
    e = routing.num_experts
    experts = routing.experts
    counts = expert_counts(routing).astype(np.float64)
    if not adjacent_only:
        mask = dispatch_mask(experts, e).astype(np.float64)
        return mask.T @ mask, counts
    pair: np.ndarray = np.zeros(e * e, dtype=np.float64)  # [E·E], then [E, E]
    for r in range(experts.shape[1] - 1):
        # int64: an imported trace keeps ids in int16, where x · E + y overflows for E > 181
        x, y = experts[:, r].astype(np.int64), experts[:, r + 1].astype(np.int64)
        ok = (x >= 0) & (y >= 0)
        pair += np.bincount(x[ok] * e + y[ok], minlength=e * e)
        pair += np.bincount(y[ok] * e + x[ok], minlength=e * e)
    pair = pair.reshape(e, e)
    np.fill_diagonal(pair, counts)
    return pair, counts


def coactivation_matrix(routing: LayerRouting, adjacent_only: bool = False) -> np.ndarray:
    """[E, E] CoAct(i, j) = #{t : i, j ∈ S_t} / #{t : i ∈ S_t} (row i conditions on expert i; rows of
    unused experts are NaN). Not symmetric: CoAct(i, j) c_i = CoAct(j, i) c_j. See `coactivation_counts`
    for the rank-adjacent (OLMoE script) variant."""
    return conditional(*coactivation_counts(routing, adjacent_only))


def coactivation_frame(trace: Trace, adjacent_only: bool = False) -> pd.DataFrame:
    """Tidy co-activation: one row per (layer, site, expert, co_expert) with pair_count, expert_count,
    coactivation = P(co_expert ∈ S_t | expert ∈ S_t) and variant ("all_pairs" or "rank_adjacent")."""
    parts = []
    for routing in trace.layers:
        e = routing.num_experts
        pair, counts = coactivation_counts(routing, adjacent_only)
        value = conditional(pair, counts)
        parts.append(
            pd.DataFrame(
                {
                    "layer": routing.layer,
                    "site": routing.site,
                    "expert": np.repeat(np.arange(e), e),
                    "co_expert": np.tile(np.arange(e), e),
                    "pair_count": pair.reshape(-1).astype(np.int64),
                    "expert_count": np.repeat(counts, e).astype(np.int64),
                    "coactivation": value.reshape(-1),
                    "variant": "rank_adjacent" if adjacent_only else "all_pairs",
                }
            )
        )
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()


# ---- cross-layer transitions and paths -------------------------------------------------------------------
def transition_counts(
    source: LayerRouting, target: LayerRouting, num_rows: int, top1: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """(joint counts [E_src, E_tgt], source counts [E_src]) over tokens routed by both layers.

    Set variant: joint[i, j] = #{t : i ∈ S^src_t, j ∈ S^tgt_t}, source[i] = #{t : i ∈ S^src_t}.
    top1: the same with top-1 experts (tokens without a dispatched expert in either layer are skipped)."""
    keep, idx = shared_rows(source.token_rows, target.token_rows, num_rows)
    es, et = source.num_experts, target.num_experts
    if top1:
        x, y = source.experts[keep, 0].astype(np.int64), target.experts[idx, 0].astype(np.int64)
        ok = (x >= 0) & (y >= 0)
        joint = np.bincount(x[ok] * et + y[ok], minlength=es * et).reshape(es, et).astype(np.float64)
        return joint, joint.sum(axis=1)
    ms = dispatch_mask(source.experts[keep], es).astype(np.float64)
    mt = dispatch_mask(target.experts[idx], et).astype(np.float64)
    return ms.T @ mt, ms.sum(axis=0)


def transition_matrix(
    source: LayerRouting, target: LayerRouting, num_rows: int, top1: bool = False
) -> np.ndarray:
    """[E_src, E_tgt] T(i → j) = P(j ∈ S^tgt_t | i ∈ S^src_t) over tokens routed by both layers.

    Normalisation: conditional on the source expert only, so a row sums to the mean number of experts the
    target layer dispatches for those tokens (k_tgt without drops), not to 1. With top1=True,
    P(top-1^tgt = j | top-1^src = i) and rows sum to 1. Rows of unused source experts are NaN.
    `num_rows` = len(trace.tokens)."""
    return conditional(*transition_counts(source, target, num_rows, top1))


def transition_frame(trace: Trace, top1: bool = False) -> pd.DataFrame:
    """Transitions between consecutive MoE layers of the same site, tidy: one row per (site, layer,
    next_layer, expert, next_expert) with count, expert_count, probability (see `transition_matrix` for
    the normalisation) and variant ("set" or "top1")."""
    parts = []
    num_rows = len(trace.tokens)
    for site, chain in _site_chains(trace).items():
        for source, target in pairwise(chain):
            joint, counts = transition_counts(source, target, num_rows, top1)
            es, et = joint.shape
            prob = conditional(joint, counts)
            parts.append(
                pd.DataFrame(
                    {
                        "site": site,
                        "layer": source.layer,
                        "next_layer": target.layer,
                        "expert": np.repeat(np.arange(es), et),
                        "next_expert": np.tile(np.arange(et), es),
                        "count": joint.reshape(-1).astype(np.int64),
                        "expert_count": np.repeat(counts, et).astype(np.int64),
                        "probability": prob.reshape(-1),
                        "variant": "top1" if top1 else "set",
                    }
                )
            )
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()


def top1_paths(trace: Trace, site: str, layers: Sequence[int] | None = None) -> tuple[list[int], np.ndarray]:
    """(layer ids, paths [N, L]): top-1 expert of each token (routed by all those layers) at each MoE layer
    of `site`, in layer order; -1 where a token had no dispatched expert."""
    wanted = None if layers is None else set(layers)
    chain = [r for r in _site_chains(trace).get(site, []) if wanted is None or r.layer in wanted]
    if not chain:
        raise KeyError(f"no MoE layers for site {site!r}{'' if layers is None else f' among {list(layers)}'}")
    num_rows = len(trace.tokens)
    rows = chain[0].token_rows
    index = np.stack([row_index(r.token_rows, num_rows)[rows] for r in chain], axis=1)  # [N, L]
    keep = (index >= 0).all(axis=1)
    index = index[keep]
    paths = np.stack([r.experts[index[:, i], 0] for i, r in enumerate(chain)], axis=1)
    return [r.layer for r in chain], paths.astype(np.int64)


def path_frame(
    trace: Trace, top_n: int = 20, layers: Sequence[int] | None = None, site: str | None = None
) -> pd.DataFrame:
    """Most frequent top-1 expert paths across consecutive MoE layers, per site: one row per (site, rank)
    with path (tuple of expert ids in layer order, -1 = every slot dropped), label ("3→1→7", "drop" for
    -1), count, share (of the tokens routed by
    all those layers), tokens and layers (tuple of layer ids). `layers` restricts the path to a window
    (over many layers nearly every path is unique)."""
    frames = []
    for name in _site_chains(trace) if site is None else [site]:
        layer_ids, paths = top1_paths(trace, name, layers)
        if len(paths) == 0:
            continue
        contiguous = np.ascontiguousarray(paths)
        keys = contiguous.view(np.dtype((np.void, contiguous.dtype.itemsize * paths.shape[1]))).ravel()
        _, first, counts = np.unique(keys, return_index=True, return_counts=True)
        order = np.argsort(-counts, kind="stable")[:top_n]
        picked = [tuple(int(x) for x in paths[first[i]]) for i in order]
        frames.append(
            pd.DataFrame(
                {
                    "site": name,
                    "rank": np.arange(len(order)),
                    "path": picked,
                    "label": ["→".join(str(x) if x >= 0 else "drop" for x in p) for p in picked],
                    "count": counts[order].astype(np.int64),
                    "share": counts[order] / len(paths),
                    "tokens": len(paths),
                    "layers": [tuple(layer_ids)] * len(order),
                }
            )
        )
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


# ---- paths over a window of consecutive layers -----------------------------------------------------------
# Over many layers and experts nearly every top-1 path is unique (E^L possible paths against T tokens: a
# 58-hop path of 256 experts never repeats), so paths are counted over a window of consecutive layers.
PATH_LAYERS = 4  # the default window up to MAX_CATEGORICAL experts (the samples' 4 layers: every layer)
PATH_LAYERS_AT_SCALE = 2  # above: pairs of layers, which repeat (256² pairs vs thousands of tokens)
_FEW_EXPERTS = 20  # moeviz.charts.scale.MAX_CATEGORICAL (analysis does not import charts)


def path_layer_ids(trace: Trace, site: str) -> list[int]:
    """The MoE layers of `site`, in order: what a path window is cut from."""
    return [r.layer for r in _site_chains(trace).get(site, [])]


def default_path_length(num_layers: int, num_experts: int) -> int:
    """Layers a path spans by default: PATH_LAYERS up to 20 experts, PATH_LAYERS_AT_SCALE above, never more
    than the model has."""
    wanted = PATH_LAYERS if num_experts <= _FEW_EXPERTS else PATH_LAYERS_AT_SCALE
    return max(1, min(wanted, num_layers))


def path_window(layer_ids: Sequence[int], start: int, length: int) -> list[int]:
    """`length` consecutive layers of `layer_ids` (a site's MoE layers, in order) from layer `start`, moved
    back so that a full window fits (a window from the last layer ends there); `start` not among them: from
    the first layer at or after it."""
    ids = list(layer_ids)
    if not ids:
        return []
    length = max(1, min(int(length), len(ids)))
    first = next((i for i, layer in enumerate(ids) if layer >= start), len(ids) - 1)
    first = min(first, len(ids) - length)
    return ids[first : first + length]
