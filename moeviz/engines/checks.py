"""The checks every importer's routing passes before it becomes a Trace: the rules a real router's output
obeys, so a file that breaks one is refused with the first place it breaks.

- `check_expert_sets`: each routed (token, layer) holds exactly k distinct expert ids in [0, E). An all-zero
  row gets its own message: monolithic GPU kernels that bypass the router make vLLM return arrays of the
  right shape filled with 0 (vLLM issue #54730; docs/engine-formats.md, "Validation").
- `layer_axis`: whether an array's layer axis counts every hidden layer or the MoE layers only, and the MoE
  layers' positions on it; dense layers written on a hidden-layer axis must hold one sentinel (0 or -1).
- `unrouted_rows`: rows an engine wrote as all -1 (vLLM's prefix-cache hits, SGLang's padding).

Vectorised over chunks of rows: a 1 M-token × 48-layer × k = 8 rollout is checked in about a second.
"""

from __future__ import annotations

import numpy as np

from moeviz.errors import EngineFormatError

_CHUNK_ROWS = 1 << 20


def first_repeated_row(ids: np.ndarray) -> int | None:
    """Index of the first row of ids [N, k] in which an id appears twice; None when every row is distinct.

    Pairwise column comparisons on a transposed copy (k(k−1)/2 contiguous vector compares per chunk): ~5×
    faster than sorting each row."""
    n, k = ids.shape
    for start in range(0, n, _CHUNK_ROWS):
        columns = np.ascontiguousarray(ids[start : start + _CHUNK_ROWS].T)
        repeated = np.zeros(columns.shape[1], dtype=bool)
        for i in range(k):
            for j in range(i + 1, k):
                repeated |= columns[i] == columns[j]
        if repeated.any():
            return start + int(np.argmax(repeated))
    return None


def check_expert_sets(ids: np.ndarray, num_experts: int, where) -> None:
    """Refuse ids [N, k] unless every row holds k distinct ids in [0, num_experts).

    `where(row) -> str` names a row for the message (file, sequence, position, layer)."""
    if ids.size == 0:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= num_experts:
        bad = np.flatnonzero(((ids < 0) | (ids >= num_experts)).any(axis=1))[0]
        raise EngineFormatError(
            f"{where(int(bad))}: expert ids {_ids(ids[bad])} outside [0, {num_experts}) "
            f"(the model has {num_experts} routed experts)"
        )
    row = first_repeated_row(ids)
    if row is None:
        return
    k = ids.shape[1]
    distinct = len(np.unique(ids[row]))
    if not ids[row].any():
        raise EngineFormatError(
            f"{where(row)}: all {k} expert ids are 0 — the all-zero routing that GPU kernels which bypass "
            "the router return (vLLM issue #54730); this capture recorded no routing"
        )
    raise EngineFormatError(
        f"{where(row)}: {distinct} distinct expert ids of {k} ({_ids(ids[row])}); a router sends each token "
        f"to exactly {k} different experts"
    )


def _ids(row: np.ndarray) -> str:
    return "[" + ", ".join(str(int(v)) for v in row) + "]"


def unrouted_rows(ids: np.ndarray) -> np.ndarray:
    """[R] bool: rows of ids [R, L, k] that are -1 in every layer and slot (tokens the engine did not run,
    e.g. vLLM's prefix-cache hits). A row -1 in some places only is left to `check_expert_sets`."""
    return np.all((ids < 0).reshape(len(ids), -1), axis=1)


def layer_axis(
    ids: np.ndarray,
    num_hidden_layers: int,
    moe_layers: tuple[int, ...],
    what: str,
    axis: int = 1,
    routed: np.ndarray | None = None,
) -> tuple[list[int], str]:
    """(positions of the MoE layers on the layer axis of `ids`, what that axis counts).

    The axis counts every hidden layer (SGLang, vLLM ≥ 0.27, Megatron's replay output) or the MoE layers
    only (vLLM 0.21); dense layers on a hidden-layer axis must hold a single sentinel (0 or -1) over the
    `routed` rows, else the file routes where the model has no router: the wrong model, most likely."""
    size = ids.shape[axis]
    if size == len(moe_layers):
        return list(range(size)), "MoE layers"
    if size != num_hidden_layers:
        raise EngineFormatError(
            f"{what}: {size} layers on the layer axis; the model has {num_hidden_layers} hidden layers, "
            f"{len(moe_layers)} of them MoE: is --model the model that produced this file?"
        )
    for layer in sorted(set(range(num_hidden_layers)) - set(moe_layers)):
        values = np.take(ids, layer, axis=axis)
        if routed is not None:
            values = values[routed]
        if values.size and not (values.min() == values.max() and int(values.flat[0]) in (0, -1)):
            raise EngineFormatError(
                f"{what}: layer {layer} is dense in the model, but the file routes tokens there "
                f"(ids {_ids(np.unique(values)[:8])}): is --model the model that produced this file?"
            )
    return list(moe_layers), "hidden layers"
