"""Two traces of the same tokens: checkpoints of one run, or any two routings of one text.

Router saturation (OLMoE, arXiv 2409.02060; docs/routing-metrics.md "Checkpoints"):
Sat_ℓ(c) = mean_t |S^{(c)}_t ∩ S^{(final)}_t| / k over a fixed token set, plus the top-1 variant
mean_t [top-1^{(c)}_t = top-1^{(final)}_t]. With capacity drops, k is replaced per token by |S^{(final)}_t|
(the experts the final actually dispatched; a token the final dropped entirely scores 1 if the checkpoint
dropped it too, else 0): identical to OLMoE's / k when nothing is dropped, and a trace against itself
stays at 1. Layers are matched by (site, layer), tokens by
(stream, seq, pos) after checking that both traces hold the same token ids in the same order per stream.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from moeviz.analysis.structure import dispatch_mask, shared_rows
from moeviz.trace import LayerRouting, Trace


def match_tokens(a: Trace, b: Trace) -> np.ndarray:
    """[T_a] row in b.tokens of each row of a.tokens; raises ValueError unless both traces hold the same
    token ids in the same order in every stream (same sequences, positions and ids)."""
    order, keys = [], []
    for trace in (a, b):
        tokens = trace.tokens
        stream = tokens["stream"].astype(str).to_numpy()
        seq, pos = tokens["seq"].to_numpy(), tokens["pos"].to_numpy()
        order.append(np.lexsort((pos, seq, stream)))
        keys.append((stream, seq, pos, tokens["token_id"].to_numpy()))
    if len(order[0]) != len(order[1]):
        counts = [dict(t.tokens["stream"].value_counts()) for t in (a, b)]
        raise ValueError(f"the traces hold different tokens: {counts[0]} vs {counts[1]} tokens per stream")
    names = ("stream", "seq", "pos", "token_id")
    for name, x, y in zip(names, keys[0], keys[1], strict=True):
        xs, ys = x[order[0]], y[order[1]]
        differ = np.nonzero(xs != ys)[0]
        if len(differ):
            i = differ[0]
            at = tuple(_py(keys[0][j][order[0][i]]) for j in range(3))
            raise ValueError(
                f"the traces hold different tokens: at (stream, seq, pos) = {at} the {name} is "
                f"{_py(xs[i])!r} in the first and {_py(ys[i])!r} in the second (in token order)"
            )
    mapping = np.empty(len(order[0]), dtype=np.int64)
    mapping[order[0]] = order[1]
    return mapping


def _py(value: object) -> object:
    """numpy scalar → Python scalar, for readable messages."""
    return value.item() if isinstance(value, np.generic) else value


def _matched_layers(a: Trace, b: Trace) -> list[tuple[LayerRouting, LayerRouting]]:
    keys_b = {r.key: r for r in b.layers}
    pairs = [(r, keys_b[r.key]) for r in a.layers if r.key in keys_b]
    if not pairs:
        raise ValueError(f"no MoE layer in common: {a.layer_keys} vs {b.layer_keys}")
    for x, y in pairs:
        if x.num_experts != y.num_experts:
            raise ValueError(f"layer {x.layer} ({x.site}): {x.num_experts} experts vs {y.num_experts}")
    return pairs


def _aligned(
    x: LayerRouting, y: LayerRouting, mapping: np.ndarray, num_rows_b: int
) -> tuple[np.ndarray, np.ndarray]:
    """(experts of x [M, k_x], experts of y [M, k_y]) for the M tokens both layers routed."""
    ia, ib = shared_rows(mapping[x.token_rows], y.token_rows, num_rows_b)
    return x.experts[ia], y.experts[ib]


def routing_agreement_frame(a: Trace, b: Trace) -> pd.DataFrame:
    """Per shared MoE layer, how much of b's routing a already has (b = the reference, e.g. the final
    checkpoint): layer, site, tokens, saturation_topk = mean_t |S^a_t ∩ S^b_t| / |S^b_t| (= / k without
    drops; see the module docstring), saturation_top1 =
    mean_t [top-1^a_t = top-1^b_t] (a token with every slot dropped in both counts as equal), jaccard =
    mean_t |S^a ∩ S^b| / |S^a ∪ S^b| (1 when both are empty). A trace against itself gives 1, 1, 1."""
    mapping = match_tokens(a, b)
    rows = []
    for x, y in _matched_layers(a, b):
        ea, eb = _aligned(x, y, mapping, len(b.tokens))
        ma, mb = dispatch_mask(ea, x.num_experts), dispatch_mask(eb, y.num_experts)
        inter = (ma & mb).sum(axis=1)
        union = (ma | mb).sum(axis=1)
        final = mb.sum(axis=1)
        saturation = np.where(final > 0, inter / np.maximum(final, 1), (ma.sum(axis=1) == 0).astype(float))
        n = len(ea)
        rows.append(
            {
                "layer": x.layer,
                "site": x.site,
                "tokens": n,
                "saturation_topk": float(saturation.mean()) if n else float("nan"),
                "saturation_top1": float((ea[:, 0] == eb[:, 0]).mean()) if n else float("nan"),
                "jaccard": float(np.where(union > 0, inter / np.maximum(union, 1), 1.0).mean())
                if n
                else float("nan"),
            }
        )
    return pd.DataFrame(rows)


def saturation_timeline(
    checkpoints: Sequence[Trace], final: Trace | None = None, names: Sequence[object] | None = None
) -> pd.DataFrame:
    """Router saturation of each checkpoint against `final` (default: the last of `checkpoints`), tidy:
    checkpoint (names[i], default i), layer, site, saturation_topk, saturation_top1 — one line per layer
    over checkpoints."""
    if not checkpoints:
        raise ValueError("no checkpoint traces given")
    final = checkpoints[-1] if final is None else final
    names = list(range(len(checkpoints))) if names is None else list(names)
    if len(names) != len(checkpoints):
        raise ValueError(f"{len(names)} names for {len(checkpoints)} checkpoints")
    parts = []
    for name, trace in zip(names, checkpoints, strict=True):
        frame = routing_agreement_frame(trace, final)
        frame.insert(0, "checkpoint", [name] * len(frame))
        parts.append(frame[["checkpoint", "layer", "site", "saturation_topk", "saturation_top1"]])
    return pd.concat(parts, ignore_index=True)


def expert_drift_frame(a: Trace, b: Trace) -> pd.DataFrame:
    """Per (layer, site, expert), how the expert's tokens changed from a to b (over tokens both routed):
    load_a, load_b (#{t : e ∈ S_t}), load_change = load_b − load_a, share_a, share_b (f_e = load / dispatched
    slots), kept = |T^a_e ∩ T^b_e| (T_e = tokens routed to e), retained = kept / load_a, jaccard =
    |T^a_e ∩ T^b_e| / |T^a_e ∪ T^b_e| (NaN if e got no token in either), drift = 1 − jaccard."""
    mapping = match_tokens(a, b)
    parts = []
    for x, y in _matched_layers(a, b):
        e = x.num_experts
        ea, eb = _aligned(x, y, mapping, len(b.tokens))
        ma, mb = dispatch_mask(ea, e), dispatch_mask(eb, e)
        load_a, load_b = ma.sum(axis=0), mb.sum(axis=0)
        kept = (ma & mb).sum(axis=0)
        union = (ma | mb).sum(axis=0)
        with np.errstate(invalid="ignore", divide="ignore"):
            jaccard = kept / union
            retained = kept / load_a
        parts.append(
            pd.DataFrame(
                {
                    "layer": x.layer,
                    "site": x.site,
                    "expert": np.arange(e),
                    "load_a": load_a,
                    "load_b": load_b,
                    "load_change": load_b - load_a,
                    "share_a": load_a / max(load_a.sum(), 1),
                    "share_b": load_b / max(load_b.sum(), 1),
                    "kept": kept,
                    "retained": retained,
                    "jaccard": jaccard,
                    "drift": 1.0 - jaccard,
                }
            )
        )
    return pd.concat(parts, ignore_index=True)
