"""The streaming summary kernel: every per-token statistic of one softmax layer in one pass over query blocks.

Each [H, rows, keys] block of scores is built once (one matmul per KV head: GQA heads are never expanded),
exponentiated once, and every statistic (mass, entropy, mean distance, sink, local and kept mass, learned
sink mass) is one multiply-and-sum against it; blocks follow the rows' allowed key intervals, so memory is
O(block), never T × T. Precision: within 1e-6 of a float64 computation from the full map
(tests/unit/test_attention_exact.py). `AttentionCapture` caches and tabulates the results.
"""

from __future__ import annotations

import math

import numpy as np

from moeviz.attention.layers import AttentionLayer

# the statistics `layer_stats` returns, each [B, H, T]; `SUMMARY_STATS` those `summaries()` tabulates
_STATS = ("mass", "entropy", "mean_distance", "sink_mass", "local_mass", "kept_mass", "learned_sink_mass")
SUMMARY_STATS = ("entropy", "mean_distance", "sink_mass", "local_mass", "learned_sink_mass")
SUMMARY_COLUMNS = ["layer", "head", "seq", "pos", *SUMMARY_STATS]
_BLOCK_ELEMENTS = 1 << 21  # [H, rows, keys] scores per block of the streaming pass (8 MiB of fp32 per buffer)
_MAX_ROWS = 512  # query rows per block at most
_ROWS_DIVISOR = 2  # rows per block: the widest row's keys / 2 (a sliding window: blocks over ~1.5 W keys)
_EXP_FLOOR = -80.0  # shifted scores are clamped here: exp(-80) < 2e-35, and exp's underflow path is slow
# Precision of the streaming pass (torch dtype names), so that every statistic stays within 1e-6 of a
# float64 computation from the full map (tests/unit/test_attention_exact.py). Scores q·kᵀ: float32 only
# where a probe of the layer shows its rounding moves the statistics by at most _FLOAT32_SCORE_TOLERANCE
# (small scores; on the trained samples, |s| ~ 30, a float32 q·kᵀ alone moves entropies by ~2.6e-6), else
# float64. exp and the sums over keys run in float32: ~5e-7 at most on the samples (mean_distance: relative).
_SCORE_DTYPE = "float64"
_FLOAT32_SCORE_TOLERANCE = 4e-7
_PROBE_ROWS = 16  # query rows per sequence the probe measures
_FLOAT32_SCORE_BOUND = 16.0  # scaling · max |q| · max |k| above this: float64 scores, no probe needed
_SUM_DTYPE = "float32"


def _key_span(lo, hi, start: int, stop: int) -> int:
    """Keys the query rows start:stop attend to, from the first to the last (rows without keys ignored)."""
    lo, hi = lo[start:stop], hi[start:stop]
    real = hi >= lo
    if not bool(real.any()):
        return 1
    return int(hi[real].max()) - int(lo[real].min()) + 1


def _blocks(lo: np.ndarray, hi: np.ndarray, heads: int):
    """Query blocks (start, stop, first key, last key + 1) of one sequence for the streaming pass.

    A block's keys span from its rows' first allowed key to their last, so rows per block follow the widest
    row: about half of it (a sliding window of W keys gives blocks of W/2 rows over 1.5 W keys, not rows over
    all T keys), at most `_MAX_ROWS`, and halved while [heads, rows, keys] exceeds `_BLOCK_ELEMENTS` (one row
    at least). Blocks of padding rows only are skipped.
    """
    real = hi >= lo
    if not bool(real.any()):
        return
    widest = int((hi - lo + 1)[real].max())
    rows = max(1, min(_MAX_ROWS, widest // _ROWS_DIVISOR))
    start, t_n = 0, len(lo)
    while start < t_n:
        stop = min(t_n, start + rows)
        while stop - start > 1 and heads * (stop - start) * _key_span(lo, hi, start, stop) > _BLOCK_ELEMENTS:
            stop = start + (stop - start) // 2
        block_real = real[start:stop]
        if bool(block_real.any()):
            yield (
                start,
                stop,
                int(lo[start:stop][block_real].min()),
                int(hi[start:stop][block_real].max()) + 1,
            )
        start = stop


def _dtypes():
    import torch

    return getattr(torch, _SCORE_DTYPE), getattr(torch, _SUM_DTYPE)


def _buffer(pool: dict, name: str, shape: tuple[int, ...], dtype):
    """A view of `shape` on a scratch buffer reused across blocks (grown when a block needs more): fresh
    large allocations page-fault on every block, which costs more than the arithmetic."""
    import torch

    size = math.prod(shape)
    flat = pool.get(name)
    if flat is None or flat.numel() < size:
        flat = pool[name] = torch.empty(size, dtype=dtype)
    return flat[:size].view(shape)


def _block_weights(
    geometry: dict, lo, hi, start: int, stop: int, k0: int, k1: int, off, window, global_tokens, score_dtype
) -> dict:
    """Masks and weights of one block, shared by every block of the same shape relative to its keys (all
    steady-state blocks of a sliding-window sequence):

    - bias [R, K]: 0 allowed, -inf blocked (None when nothing is blocked); empty [R]: rows without keys
    - distance [R, K]: i − j where allowed, else 0
    - local: (first, last, [R, last − first]) the key columns of the band 0 <= i − j < window, 1 where
      local and allowed; extra: the same for global keys (position < global_tokens) outside the band
    - pos0 [R]: 1 where position 0 is an allowed key of the row, None when the block does not reach it
    """
    import torch

    rows, keys = stop - start, k1 - k0
    rel_lo, rel_hi = lo[start:stop] - k0, hi[start:stop] - k0
    sink_col = off - k0
    global_end = min(max(sink_col + global_tokens, 0), keys)
    key: tuple  # the block's geometry: what its masks and weights depend on
    key = (start - k0, keys, rel_lo.tobytes(), rel_hi.tobytes(), sink_col if 0 <= sink_col < keys else None)
    key += (global_end, window, score_dtype)
    found = geometry.get(key)
    if found is not None:
        return found
    f32 = torch.float32
    cols = torch.arange(keys, dtype=f32)
    allowed = (cols >= torch.from_numpy(rel_lo).to(f32)[:, None]) & (
        cols <= torch.from_numpy(rel_hi).to(f32)[:, None]
    )
    distance = (
        torch.arange(start - k0, stop - k0, dtype=f32)[:, None] - cols
    )  # i − j (columns = pos + offset)
    first, last = min(max(start - k0 - window + 1, 0), keys), min(max(stop - k0, 0), keys)
    band = distance[:, first:last]
    local = ((band >= 0) & (band < window) & allowed[:, first:last]).to(f32)
    extra = None
    if global_end:
        extra = (
            allowed[:, :global_end] & ((distance[:, :global_end] < 0) | (distance[:, :global_end] >= window))
        ).to(f32)
    empty = rel_hi < rel_lo
    all_allowed = bool((rel_lo <= 0).all() and (rel_hi >= keys - 1).all())
    found = {
        "bias": None
        if all_allowed
        else torch.full((rows, keys), -math.inf, dtype=score_dtype).masked_fill_(allowed, 0.0),
        "empty": torch.from_numpy(empty) if empty.any() else None,
        "distance": distance.mul_(allowed),
        "local": (first, last, local),
        "extra": (0, global_end, extra) if global_end else None,
        "pos0": allowed[:, sink_col].to(f32) if 0 <= sink_col < keys else None,
    }
    # Kept for reuse up to 2 · _BLOCK_ELEMENTS cells in all (causal blocks all differ: bounded memory).
    cells = geometry.get("cells", 0) + rows * keys
    if cells <= 2 * _BLOCK_ELEMENTS:
        geometry[key] = found
        geometry["cells"] = cells
    return found


def _float32_scores_suffice(spec: AttentionLayer) -> bool:
    """Whether computing this layer's scores q·kᵀ in float32 keeps every statistic within
    `_FLOAT32_SCORE_TOLERANCE` of a float64 computation, measured on a probe of `_PROBE_ROWS` query rows
    per sequence spread over it (all heads, all their allowed keys): the first-order change of the
    statistics under the score errors δs = s32 − s64, with p the float64 map and δ̄ = Σ p δs:
    total variation Σ p |δs − δ̄| (bounds every mass), Σ p |δs − δ̄| |log p + 1| (entropy) and
    Σ p |δs − δ̄| |i − j| / mass relative to max(1, mean distance). Large scores (trained models: |s| ~ 30)
    fail it, small ones (random weights) pass."""
    import torch

    bound = (
        spec.scaling
        * float(torch.linalg.vector_norm(torch.from_numpy(spec.query), dim=-1).max())
        * float(torch.linalg.vector_norm(torch.from_numpy(spec.key), dim=-1).max())
    )
    if bound > _FLOAT32_SCORE_BOUND:  # |s| may reach it (Cauchy-Schwarz): float64 without probing
        return False
    b_n, h_n, _, dim = spec.query.shape
    groups = h_n // spec.num_kv_heads
    worst = 0.0
    for b in range(b_n):
        real = np.flatnonzero(spec.hi[b] >= spec.lo[b])
        if not len(real):
            continue
        rows = real[np.linspace(0, len(real) - 1, min(_PROBE_ROWS, len(real))).astype(np.int64)]
        lo, hi = spec.lo[b, rows], spec.hi[b, rows]
        k0, k1 = int(lo.min()), int(hi.max()) + 1
        q = torch.from_numpy(spec.query[b][:, rows])  # [H, P, D]
        k = torch.from_numpy(spec.key[b][:, k0:k1])  # [Hkv, K, D]
        n = len(rows)
        scores = []
        for dtype in (torch.float32, torch.float64):
            s = torch.matmul(
                (q.to(dtype) * spec.scaling).reshape(-1, groups * n, dim), k.to(dtype).transpose(1, 2)
            )
            s = s.reshape(h_n, n, -1).double()
            if spec.softcap is not None:
                s = torch.tanh(s / spec.softcap) * spec.softcap
            scores.append(s)
        cols = torch.arange(k0, k1)
        allowed = (cols >= torch.from_numpy(lo)[:, None]) & (cols <= torch.from_numpy(hi)[:, None])
        logits = scores[1].masked_fill(~allowed, -math.inf)
        if spec.sinks is not None:
            sink = torch.from_numpy(spec.sinks).double()[:, None, None].expand(h_n, n, 1)
            p = torch.softmax(torch.cat([logits, sink], -1), -1)[..., :-1]
        else:
            p = torch.softmax(logits, -1)
        delta = (scores[0] - scores[1]).masked_fill(~allowed, 0.0)
        change = p * (delta - (p * delta).sum(-1, keepdim=True)).abs()  # |δp| to first order
        mass = p.sum(-1).clamp_min(1e-300)
        distance = (torch.from_numpy(rows)[:, None] - cols).abs().double()
        mean_distance = (p * distance).sum(-1) / mass
        log_p = torch.log(p.clamp_min(1e-300))
        bounds = (
            change.sum(-1),
            (change * (log_p + 1).abs()).sum(-1),
            (change * distance).sum(-1) / mass / mean_distance.clamp_min(1.0),
        )
        worst = max(worst, *(float(x.max()) for x in bounds))
    return worst <= _FLOAT32_SCORE_TOLERANCE


def score_precision(spec: AttentionLayer) -> str:
    """The torch dtype name (`"float32"` or `_SCORE_DTYPE`) `layer_stats` computes this layer's scores in:
    float32 where `_float32_scores_suffice`. A property of the layer, not of the window: callers that
    summarise a layer at several windows measure it once (`AttentionCapture` keeps it per layer)."""
    if _SCORE_DTYPE == "float64" and _float32_scores_suffice(spec):
        return "float32"
    return _SCORE_DTYPE


def layer_stats(
    spec: AttentionLayer,
    offsets: np.ndarray,
    window: int,
    global_tokens: int,
    geometry: dict | None = None,
    precision: str | None = None,
) -> dict[str, np.ndarray]:
    """All per-token statistics (`_STATS`, each [B, H, T]) of all heads of one softmax layer in one
    streaming pass; `AttentionCapture` caches them per (layer, window, global_tokens).

    Per query block, all heads at once: the scores [H, R, K] are computed once (one matmul per KV head: the
    query heads of a group share it, no GQA expansion), shifted by the row maximum and exponentiated into a
    second buffer e; every statistic is then one multiply-and-sum of e with the shifted scores or with an
    [R, K] weight (key distance, local band, kept keys; built once per block shape), and the [H, R] sums are
    combined in float64. Scores are computed and shifted in float32 where `_float32_scores_suffice`, else in
    `_SCORE_DTYPE`; exp and sums run in `_SUM_DTYPE` (see there for the precision each needs). Shifted
    scores are clamped at `_EXP_FLOOR` (exp < 2e-35, far below the resolution of a row sum >= 1) so exp
    never takes its slow underflow path; blocked keys carry -inf before the row maximum and zero weight in
    every masked sum. Memory: a few [H, R, K] buffers of about `_BLOCK_ELEMENTS` each, never [T, T].
    `precision`: the layer's `score_precision` when the caller knows it already (None: measured here).
    """
    import torch

    score_dtype = getattr(torch, precision or score_precision(spec))
    sum_dtype = _dtypes()[1]
    b_n, h_n, t_n, dim = spec.query.shape
    groups = h_n // spec.num_kv_heads
    raw = np.zeros((6, b_n, h_n, t_n), dtype=np.float64)  # per row: the sums over keys `_combine` needs
    row_max = None if spec.sinks is None else np.zeros((b_n, h_n, t_n), dtype=np.float64)
    query = torch.from_numpy(spec.query)
    sinks = None if spec.sinks is None else torch.from_numpy(spec.sinks).to(score_dtype)[:, None, None]
    pool: dict = {}
    geometry = {} if geometry is None else geometry  # one per (window, global_tokens): see _block_weights
    for b in range(b_n):
        off = int(offsets[b])
        lo_b, hi_b = spec.lo[b], spec.hi[b]
        key = torch.from_numpy(spec.key[b]).to(score_dtype)  # [Hkv, S, D]
        plan = ("blocks", lo_b.tobytes(), hi_b.tobytes(), h_n)  # layers with the same intervals share it
        if plan not in geometry:
            geometry[plan] = list(_blocks(lo_b, hi_b, h_n))
        for start, stop, k0, k1 in geometry[plan]:
            rows, keys = stop - start, k1 - k0
            w = _block_weights(
                geometry, lo_b, hi_b, start, stop, k0, k1, off, window, global_tokens, score_dtype
            )
            q = _buffer(pool, "q", (h_n, rows, dim), score_dtype)
            q.copy_(query[b, :, start:stop]).mul_(spec.scaling)
            s = _buffer(pool, "s", (h_n, rows, keys), score_dtype)
            torch.matmul(
                q.view(-1, groups * rows, dim),
                key[:, k0:k1].transpose(1, 2),
                out=s.view(-1, groups * rows, keys),
            )
            if spec.softcap is not None:
                s.div_(spec.softcap).tanh_().mul_(spec.softcap)
            if w["bias"] is not None:
                s.add_(w["bias"])
            m = s.amax(-1, keepdim=True)  # [H, R, 1]
            if sinks is not None:
                m = torch.maximum(m, sinks)
            if w["empty"] is not None:
                m.masked_fill_(w["empty"][None, :, None], 0.0)
            s.sub_(m).clamp_min_(_EXP_FLOOR)
            if sum_dtype != score_dtype:
                s = _buffer(pool, "s_low", (h_n, rows, keys), sum_dtype).copy_(s)
            e = _buffer(pool, "e", (h_n, rows, keys), sum_dtype)
            torch.exp(s, out=e)
            tmp = _buffer(pool, "t", (h_n, rows, keys), sum_dtype)
            sums = [
                e.sum(-1),  # Σ e
                torch.mul(e, s, out=tmp).sum(-1),  # Σ e·(s − m)
                torch.mul(e, w["distance"], out=tmp).sum(-1),  # Σ e·(i − j)
            ]
            for part in ("local", "extra"):  # Σ e over the local band, and over global keys outside it
                if w[part] is None:
                    sums.append(torch.zeros_like(sums[0]))
                    continue
                first, last, weight = w[part]
                band = _buffer(pool, "t", (h_n, rows, last - first), sum_dtype)
                sums.append(torch.mul(e[:, :, first:last], weight, out=band).sum(-1))
            sums.append(e[:, :, off - k0] * w["pos0"] if w["pos0"] is not None else torch.zeros_like(sums[0]))
            raw[:, b, :, start:stop] = torch.stack(sums).numpy()  # float32 sums into the float64 array
            if row_max is not None:  # with sinks
                row_max[b, :, start:stop] = m[..., 0].numpy()
    return _combine(raw, row_max, spec, spec.hi < spec.lo)


def _combine(
    raw: np.ndarray, row_max: np.ndarray | None, spec: AttentionLayer, empty: np.ndarray
) -> dict[str, np.ndarray]:
    """The statistics from a layer's raw sums over keys (`layer_stats`), in float64 for all rows at once.

    raw [6, B, H, T]: Σ e, Σ e·(s − m), Σ e·(i − j), Σ e over the local band, over global keys outside it,
    e at position 0; row_max [B, H, T]: the m each row was shifted by (for the learned sink's e = exp(sink −
    m)), None without sinks; empty [B, T]: rows without keys (padding), whose statistics are all 0."""
    mass_e, ent_e, dist_e, local_e, extra_e, pos0_e = raw
    sink_e: np.ndarray | None = None
    if row_max is not None and spec.sinks is not None:
        sink_e = np.exp(spec.sinks.astype(np.float64)[None, :, None] - row_max)
    z = mass_e if sink_e is None else mass_e + sink_e  # >= 1 on rows with keys
    z = np.where(z > 0, z, 1.0)
    mass = mass_e / z
    values = (
        mass,
        np.log(z) * mass - ent_e / z,  # entropy
        dist_e / np.where(mass_e > 0, mass_e, 1.0),  # mean distance
        pos0_e / z,  # sink mass
        local_e / z,  # local mass
        (local_e + extra_e) / z,  # kept mass
        np.zeros_like(z) if sink_e is None else sink_e / z,  # learned sink mass
    )
    stats = dict(zip(_STATS, values, strict=True))
    for array in stats.values():
        array[np.broadcast_to(empty[:, None, :], array.shape)] = 0.0
    return stats
