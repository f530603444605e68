"""The trace file format: a Trace's parts to one Parquet file and back.

Format `moeviz.trace/4`: one row per (token, layer, rank) with ROUTING_COLUMNS, and a `logits` column
(list<float32>, the token's E router logits) on each token's rank-0 row only, null on the others (as the store
keeps per-token values). The file's `moeviz` metadata holds the format, the model info, the token table and
each layer's facts. `Trace.to_parquet` / `Trace.from_parquet` call this.

Versions: 4 adds each layer's `zero_experts`, `hash_routed`, `bias_on` and `loop_pass` and the model's
`language_model` (families transformers 5.24 added: `LayerRouting`, `ModelInfo`); a version-3 file is a
version-4 file without them (none, False, "scores", 0, ""). 3 adds each layer's `has_logits`, `has_weights`
and `ranked` (routing imported from an engine, `moeviz.engines`): a layer without logits has null logits on
every row, one without weights NaN weights. Version 2 is version 3 with every layer's logits and weights
present and ranked; version 1 repeated the logits on all k rows. All four are read.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from moeviz.errors import TraceFormatError
from moeviz.trace.atomic import writing_atomically
from moeviz.trace.records import TOKEN_COLUMNS, LayerRouting, ModelInfo, absent

TRACE_FORMAT = "moeviz.trace/4"
READABLE_FORMATS = ("moeviz.trace/1", "moeviz.trace/2", "moeviz.trace/3", TRACE_FORMAT)


def write_trace(
    path: Path, model: ModelInfo, tokens: pd.DataFrame, layers: list[LayerRouting], routing: pd.DataFrame
) -> Path:
    """Write a trace (its model info, token table, layers and their tidy `routing` frame) to `path`,
    atomically (`moeviz.trace.atomic`)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pandas(routing, preserve_index=False)
    table = table.append_column("logits", _rank0_logits_column(layers))
    meta = {
        "format": TRACE_FORMAT,
        "model": asdict(model),
        "tokens": {c: tokens[c].tolist() for c in TOKEN_COLUMNS},
        "layers": [_layer_meta(r) for r in layers],
    }
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), b"moeviz": json.dumps(meta)})
    with writing_atomically(path) as handle:
        pq.write_table(
            table,
            handle,
            compression="zstd",
            # distinct floats: no dictionary; bytes split by significance compress well
            use_dictionary=[c for c in table.column_names if c != "logits"],
            column_encoding={"logits.list.element": "BYTE_STREAM_SPLIT"},
        )
    return path


def read_trace(path: Path) -> tuple[ModelInfo, pd.DataFrame, list[LayerRouting]]:
    """(model info, token table, layers) of a file written by `write_trace` (format version 2, or 1);
    TraceFormatError, naming the file, for anything else."""
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for non-Parquet input
        raise TraceFormatError(f"{path}: not a readable Parquet file ({exc})") from exc
    raw = (table.schema.metadata or {}).get(b"moeviz")
    if raw is None:
        raise TraceFormatError(f"{path}: a Parquet file, but not a moeviz trace (no 'moeviz' metadata)")
    meta = json.loads(raw)
    if meta.get("format") not in READABLE_FORMATS:
        raise TraceFormatError(
            f"{path}: trace format {meta.get('format')!r}, expected one of {list(READABLE_FORMATS)}"
        )
    per_rank = meta["format"] == "moeviz.trace/1"  # version 1: the logits repeated on every rank's row
    tokens = pd.DataFrame(meta["tokens"])[TOKEN_COLUMNS]
    frame = table.drop_columns(["logits"]).to_pandas()
    logits_all = table.column("logits").combine_chunks()
    token_index = pd.MultiIndex.from_frame(tokens[["stream", "seq", "pos"]])
    layers, start = [], 0
    for info in meta["layers"]:
        n_rows = info["num_tokens"] * info["k"]
        if start + n_rows > len(frame):
            raise TraceFormatError(f"{path}: {len(frame)} routing rows, metadata accounts for more")
        part = frame.iloc[start : start + n_rows : info["k"]]
        token_rows = token_index.get_indexer(pd.MultiIndex.from_frame(part[["stream", "seq", "pos"]]))
        if (token_rows < 0).any():
            raise TraceFormatError(f"{path}: routing rows refer to tokens missing from the token table")
        rows = frame.iloc[start : start + n_rows]
        logits = _layer_logits(path, info, logits_all.slice(start, n_rows), per_rank)
        layers.append(_layer_from_rows(info, token_rows, rows, logits))
        start += n_rows
    if start != len(frame):
        raise TraceFormatError(f"{path}: {len(frame)} routing rows, metadata accounts for {start}")
    return ModelInfo(**meta["model"]), tokens, layers


def _rank0_logits_column(layers: list[LayerRouting]):
    """One Arrow list<float32> column over all routing rows (layer by layer, k rows per token): each token's
    [E] logits on its rank-0 row, null on the other k-1 (E may differ between layers) and on every row of a
    layer without logits."""
    import pyarrow as pa

    lengths, valid, values = [], [], []
    for routing in layers:
        n, k = routing.experts.shape
        rank0 = np.zeros(n * k, dtype=bool)
        if routing.has_logits:
            rank0[::k] = True
            values.append(np.ascontiguousarray(routing.logits, dtype=np.float32).reshape(-1))
        lengths.append(np.where(rank0, routing.num_experts, 0).astype(np.int64))
        valid.append(rank0)
    lengths_all = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    offsets = np.zeros(len(lengths_all) + 1, dtype=np.int64)
    np.cumsum(lengths_all, out=offsets[1:])
    if offsets[-1] >= 2**31:
        raise ValueError("trace too large for one Parquet file: more than 2^31 logits")
    null = ~np.concatenate(valid) if valid else np.zeros(0, bool)
    return pa.ListArray.from_arrays(
        pa.array(offsets.astype(np.int32), type=pa.int32()),
        pa.array(np.concatenate(values) if values else np.zeros(0, np.float32), type=pa.float32()),
        mask=pa.array(null, type=pa.bool_()),
    )


def _layer_logits(path: Path, info: dict[str, Any], column, per_rank: bool) -> np.ndarray:
    """[N, E] float32 logits of one layer from its [N·k] rows of the `logits` column (rank-0 rows only in
    version 2; every row, k equal copies, in version 1)."""
    n, k, e = info["num_tokens"], info["k"], info["num_experts"]
    if not info.get("has_logits", True):
        if column.null_count != len(column):
            raise TraceFormatError(f"{path}: layer {info['layer']} has no logits, yet its rows hold some")
        return absent(n, e)
    flat = np.asarray(column.flatten().to_numpy(zero_copy_only=False), dtype=np.float32)
    expected = n * k * e if per_rank else n * e
    if flat.size != expected:
        raise TraceFormatError(f"{path}: layer {info['layer']}: {flat.size} logits, expected {expected}")
    return flat.reshape(n, k, e)[:, 0] if per_rank else flat.reshape(n, e)


def _layer_meta(routing: LayerRouting) -> dict[str, Any]:
    return {
        "layer": routing.layer,
        "site": routing.site,
        "num_tokens": len(routing.token_rows),
        "k": routing.k,
        "num_experts": routing.num_experts,
        "score_fn": routing.score_fn,
        "bias": None if routing.bias is None else routing.bias.astype(float).tolist(),
        "decision_source": routing.decision_source,
        "top_k": routing.top_k,
        "capacity": routing.capacity,
        "shared_experts": routing.shared_experts,
        "module": routing.module,
        "n_group": routing.n_group,
        "topk_group": routing.topk_group,
        "group_score": routing.group_score,
        "has_logits": routing.has_logits,
        "has_weights": routing.has_weights,
        "ranked": routing.ranked,
        "zero_experts": routing.zero_experts,
        "hash_routed": routing.hash_routed,
        "bias_on": routing.bias_on,
        "loop_pass": routing.loop_pass,
    }


def _layer_from_rows(
    info: dict[str, Any], token_rows: np.ndarray, part: pd.DataFrame, logits: np.ndarray
) -> LayerRouting:
    n, k = info["num_tokens"], info["k"]
    bias = None if info["bias"] is None else np.asarray(info["bias"], dtype=np.float32)
    has_weights = info.get("has_weights", True)  # version 3 keys; versions 1-2 always had both and ranks
    weights = part["weight"].to_numpy().astype(np.float32).reshape(n, k) if has_weights else absent(n, k)
    return LayerRouting(
        layer=info["layer"],
        site=info["site"],
        token_rows=token_rows,
        logits=logits,
        experts=part["expert"].to_numpy().reshape(n, k),
        weights=weights,
        score_fn=info["score_fn"],
        bias=bias,
        decision_source=info["decision_source"],
        top_k=info["top_k"],
        capacity=info["capacity"],
        shared_experts=info["shared_experts"],
        module=info["module"],
        n_group=info.get("n_group"),  # absent from traces written before group facts were recorded
        topk_group=info.get("topk_group"),
        group_score=info.get("group_score"),
        has_logits=info.get("has_logits", True),
        has_weights=has_weights,
        ranked=info.get("ranked", True),
        zero_experts=info.get("zero_experts", 0),  # absent from traces written before they were recorded
        hash_routed=info.get("hash_routed", False),
        bias_on=info.get("bias_on", "scores"),
        loop_pass=info.get("loop_pass", 0),
    )
