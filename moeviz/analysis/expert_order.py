"""Orderings and filters of the expert axis, for views that must stay legible at hundreds of experts.

- `expert_order(load, by=...)`: a permutation of expert ids: by id, by load (most loaded first), or by the
  first principal component of the co-activation matrix (experts that fire together end up side by side).
- `top_experts(frame, n)`: the rows of a per-expert frame for the `n` most loaded experts only.
- `expert_options(load)`: labels → ids for a searchable expert picker.

Pure numpy/pandas; deterministic (ties by expert id, PC1 with a fixed sign).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import pandas as pd

OrderBy = Literal["id", "load", "coactivation"]
ORDERS: tuple[str, ...] = ("id", "load", "coactivation")


def expert_counts(load: pd.DataFrame | np.ndarray | pd.Series, column: str = "count") -> np.ndarray:
    """Per-expert load [E] (float64) from counts [E] (array or Series, position = expert id) or from a frame
    with columns `expert` and `column` (e.g. `expert_balance_frame` rows of one or several layers: summed
    over layers; experts absent from the frame count 0)."""
    if isinstance(load, pd.DataFrame):
        if "expert" not in load or column not in load:
            raise ValueError(f"expected columns 'expert' and {column!r}, got {list(load.columns)}")
        experts = load["expert"].to_numpy(dtype=np.int64)
        valid = experts >= 0  # -1 = dropped slots, not an expert
        size = int(experts[valid].max()) + 1 if valid.any() else 0
        values = load[column].to_numpy(dtype=np.float64)[valid]
        return np.bincount(experts[valid], weights=np.nan_to_num(values), minlength=size)
    counts = np.asarray(load, dtype=np.float64).reshape(-1)
    return np.nan_to_num(counts)


def symmetric_coactivation(
    coactivation: pd.DataFrame | np.ndarray, num_experts: int | None = None
) -> np.ndarray:
    """A symmetric [E, E] co-activation matrix (float64) from an array, or from `coactivation_frame` rows
    (one or several layers: `pair_count` summed, else `coactivation` averaged), symmetrised as (C + Cᵀ)/2."""
    if isinstance(coactivation, pd.DataFrame):
        column = "pair_count" if "pair_count" in coactivation else "coactivation"
        ids = np.concatenate([coactivation["expert"].to_numpy(), coactivation["co_expert"].to_numpy()])
        largest = int(ids.max()) if len(ids) else -1
        e = max(num_experts or 0, int(largest) + 1)
        i = coactivation["expert"].to_numpy(dtype=np.int64)
        j = coactivation["co_expert"].to_numpy(dtype=np.int64)
        flat = i * e + j
        values = np.nan_to_num(coactivation[column].to_numpy(dtype=np.float64))
        # float64 with weights (numpy's stub says intp whatever the weights)
        total: np.ndarray = np.bincount(flat, weights=values, minlength=e * e).reshape(e, e)
        if column == "coactivation":
            total /= np.maximum(np.bincount(flat, minlength=e * e).reshape(e, e), 1)
        matrix = total
    else:
        matrix = np.nan_to_num(np.asarray(coactivation, dtype=np.float64))
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1]:
        raise ValueError(f"co-activation must be a square [E, E] matrix, got {list(matrix.shape)}")
    return (matrix + matrix.T) / 2


def coactivation_pc1(coactivation: pd.DataFrame | np.ndarray, num_experts: int | None = None) -> np.ndarray:
    """Each expert's coordinate [E] on the first principal component of the co-activation matrix.

    Rows of the symmetrised matrix (diagonal zeroed: an expert's co-activation with itself says nothing)
    are the experts' profiles; they are centred and decomposed with an SVD. Sign: the lowest-id expert
    with a non-zero coordinate is negative, so sorting ascending puts it in the first block.
    """
    matrix = symmetric_coactivation(coactivation, num_experts).copy()
    e = matrix.shape[0]
    if e == 0:
        return np.zeros(0)
    np.fill_diagonal(matrix, 0.0)
    centred = matrix - matrix.mean(axis=0, keepdims=True)
    if not np.any(centred):
        return np.zeros(e)
    u, s, _ = np.linalg.svd(centred, full_matrices=False)
    pc1 = u[:, 0] * s[0]
    tol = 1e-9 * max(float(np.abs(pc1).max()), 1e-300)
    nonzero = np.flatnonzero(np.abs(pc1) > tol)
    if len(nonzero) and pc1[nonzero[0]] > 0:
        pc1 = -pc1
    pc1[np.abs(pc1) <= tol] = 0.0
    return pc1


def expert_order(
    expert_balance_or_counts: pd.DataFrame | np.ndarray | pd.Series,
    by: OrderBy = "id",
    coactivation: pd.DataFrame | np.ndarray | None = None,
) -> np.ndarray:
    """A permutation of expert ids [E] (int64) for an expert axis.

    `expert_balance_or_counts`: `expert_balance_frame` rows (columns expert, count; several layers are
    summed) or counts [E]. `by`:
    - "id": 0, 1, …, E−1;
    - "load": most loaded first (ties by id);
    - "coactivation": ascending coordinate on the first principal component of `coactivation` (an [E, E]
      matrix, e.g. `structure.coactivation_counts(routing)[0]` or `coactivation_matrix(routing)`, or
      `coactivation_frame` rows of one or several layers; see `coactivation_pc1`), ties by load then id.
      Experts that are dispatched together land next to each other.
    E is the larger of the load's and the co-activation's expert counts.
    """
    if by not in ORDERS:
        raise ValueError(f"unknown expert order {by!r} (expected one of {', '.join(ORDERS)})")
    counts = expert_counts(expert_balance_or_counts)
    if by == "coactivation":
        if coactivation is None:
            raise ValueError("expert_order(by='coactivation') needs the co-activation matrix or frame")
        pc1 = coactivation_pc1(coactivation, len(counts) or None)
        e = max(len(counts), len(pc1))
        counts = np.pad(counts, (0, e - len(counts)))
        pc1 = np.pad(pc1, (0, e - len(pc1)))
        return np.lexsort((np.arange(e), -counts, pc1)).astype(np.int64)
    e = len(counts)
    if by == "load":
        return np.lexsort((np.arange(e), -counts)).astype(np.int64)
    return np.arange(e, dtype=np.int64)


def top_experts(frame: pd.DataFrame, n: int, column: str = "count") -> pd.DataFrame:
    """The rows of `frame` (columns expert and `column`, e.g. `expert_balance_frame`, one or several layers)
    for its `n` most loaded experts (load summed over layers; ties by lower id), in the frame's own order.
    Rows with expert -1 (dropped slots) are not experts and are left out."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    keep = expert_order(expert_counts(frame, column), by="load")[:n]
    return frame[frame["expert"].isin(keep)]


def expert_options(
    expert_balance_or_counts: pd.DataFrame | np.ndarray | pd.Series, order: np.ndarray | None = None
) -> dict[str, int]:
    """Labels → expert id for a searchable expert picker, in `order` (default: most loaded first).

    Each label starts with the id, so typing the id finds it: "17 · 412 slots · 2.31× fair" (utilisation =
    count / mean count over the experts, summed over layers for a multi-layer frame; "dead" when 0)."""
    counts = expert_counts(expert_balance_or_counts)
    mean = counts.mean() if len(counts) else 0.0
    ids = expert_order(counts, by="load") if order is None else np.asarray(order, dtype=np.int64)
    options = {}
    for e in ids:
        c = counts[e] if e < len(counts) else 0.0
        load = "dead" if c == 0 else f"{c / mean:.2f}× fair" if mean > 0 else ""
        options[f"{e} · {c:g} slots · {load}"] = int(e)
    return options
