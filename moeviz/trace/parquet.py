"""The trace file format: a Trace's parts to one Parquet file and back.

Format `moeviz.trace/5`: one row per (token, layer, rank) with ROUTING_COLUMNS, and a `logits` column
(list<float32>, the token's E router logits) on each token's rank-0 row only, null on the others (as the store
keeps per-token values). The file's `moeviz` metadata holds the format, the model info, the token table and
each layer's facts; the key `moeviz.sha256` beside it holds the SHA-256 of those bytes, and every data page
carries a CRC checksum. A file is validated before it is trusted (`moeviz.trace.validate`).
`Trace.to_parquet` / `Trace.from_parquet` call this.

Versions: 5 adds the metadata's hash and the page checksums (both verified on read; a version-4 file has
neither). 4 adds each layer's `zero_experts`, `hash_routed`, `bias_on` and `loop_pass` and the model's
`language_model` (families transformers 5.24 added: `LayerRouting`, `ModelInfo`); a version-3 file is a
version-4 file without them (none, False, "scores", 0, ""). 3 adds each layer's `has_logits`, `has_weights`
and `ranked` (routing imported from an engine, `moeviz.engines`): a layer without logits has null logits on
every row, one without weights NaN weights. Version 2 is version 3 with every layer's logits and weights
present and ranked; version 1 repeated the logits on all k rows. All five are read.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from moeviz.errors import TraceFormatError
from moeviz.trace import validate
from moeviz.trace.atomic import writing_atomically
from moeviz.trace.records import TOKEN_COLUMNS, LayerRouting, ModelInfo, absent

TRACE_FORMAT = "moeviz.trace/5"
READABLE_FORMATS = tuple(f"moeviz.trace/{v}" for v in range(1, 6))


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
    raw = json.dumps(meta).encode()
    table = table.replace_schema_metadata(
        {
            **(table.schema.metadata or {}),
            validate.META_KEY: raw,
            validate.HASH_KEY: validate.metadata_hash(raw),
        }
    )
    with writing_atomically(path) as handle:
        pq.write_table(
            table,
            handle,
            compression="zstd",
            write_page_checksum=True,
            # distinct floats: no dictionary; bytes split by significance compress well
            use_dictionary=[c for c in table.column_names if c != "logits"],
            column_encoding={"logits.list.element": "BYTE_STREAM_SPLIT"},
        )
    return path


def read_trace(path: Path) -> tuple[ModelInfo, pd.DataFrame, list[LayerRouting]]:
    """(model info, token table, layers) of a file written by `write_trace` (any READABLE_FORMATS), validated
    before it is trusted (`moeviz.trace.validate`); TraceFormatError, naming the file, for anything else."""
    import pyarrow as pa
    import pyarrow.compute as pc

    footer = validate.open_footer(path)
    meta = validate.read_metadata(path, footer, hashed=lambda fmt: fmt == TRACE_FORMAT)
    if meta.get("format") not in READABLE_FORMATS:
        raise TraceFormatError(
            f"{path}: trace format {meta.get('format')!r}, expected one of {list(READABLE_FORMATS)}"
        )
    version = int(meta["format"].rsplit("/", 1)[1])
    per_rank = version == 1  # version 1: the logits repeated on every rank's row
    keys = {"format", "model", "tokens", "layers"}
    validate.require(
        path, "metadata", set(meta) == keys, f"expected the keys {sorted(keys)}, got {sorted(meta)}"
    )
    model = validate.model_info(path, meta["model"])
    tokens = validate.token_table(path, meta["tokens"])
    validate.require(path, "layers", isinstance(meta["layers"], list), "expected a list")
    infos = [validate.layer_facts(path, i, raw, len(tokens)) for i, raw in enumerate(meta["layers"])]
    rows = sum(info["num_tokens"] * info["k"] for info in infos)
    logits = sum(
        info["num_tokens"] * info["num_experts"] * (info["k"] if per_rank else 1)
        for info in infos
        if info.get("has_logits", True)
    )
    validate.check_footer(
        path,
        footer,
        rows=rows,
        columns={**_COLUMN_KINDS, "logits": "float list"},
        needs=rows * _BYTES_PER_ROW + logits * 8,  # the column and its float32 copy
    )
    try:
        table = footer.read(columns=[*_COLUMN_KINDS, "logits"])
    except (OSError, pa.ArrowException) as exc:  # a page whose CRC does not match, a damaged page
        raise TraceFormatError(f"{path}: a damaged data page ({exc})") from exc
    validate.no_nulls(
        path, table, [name for name in _COLUMN_KINDS if name != "weight"]
    )  # NaN is stored as null
    columns = {name: table.column(name).to_numpy() for name in ("seq", "pos", "layer", "rank", "expert")}
    weight = table.column("weight").to_numpy().astype(np.float32, copy=False)
    streams = pc.dictionary_encode(table.column("stream").combine_chunks())
    stream_codes = streams.indices.to_numpy(zero_copy_only=False)
    stream_names = np.asarray(streams.dictionary.to_pylist(), dtype=object)
    logits_all = table.column("logits").combine_chunks()
    token_index = pd.MultiIndex.from_frame(tokens[["stream", "seq", "pos"]])
    layers, start = [], 0
    for index, info in enumerate(infos):
        n, k, n_rows = info["num_tokens"], info["k"], info["num_tokens"] * info["k"]
        part = {name: values[start : start + n_rows] for name, values in columns.items()}
        codes = stream_codes[start : start + n_rows]
        where = f"layers[{index}] (layer {info['layer']})"
        validate.require(path, where, bool((part["layer"] == info["layer"]).all()), "rows of another layer")
        validate.require(
            path, where, bool((part["rank"] == np.tile(np.arange(k), n)).all()), f"ranks are not 0 … {k - 1}"
        )
        for name, values in (("seq", part["seq"]), ("pos", part["pos"]), ("stream", codes)):
            grid = values.reshape(n, k)
            validate.require(
                path, where, bool((grid == grid[:, :1]).all()), f"a token's rows differ in {name}"
            )
        experts = part["expert"].reshape(n, k)
        validate.require(
            path,
            where,
            experts.size == 0 or (experts.min() >= -1 and experts.max() < info["num_experts"]),
            f"expert ids outside -1 … {info['num_experts'] - 1}",
        )
        keys = pd.MultiIndex.from_arrays([stream_names[codes[::k]], part["seq"][::k], part["pos"][::k]])
        token_rows = token_index.get_indexer(keys)
        validate.require(
            path, where, bool((token_rows >= 0).all()), "rows of tokens missing from the token table"
        )
        validate.require(path, where, len(np.unique(token_rows)) == n, "a token routed twice")
        layer_logits = _layer_logits(path, info, logits_all.slice(start, n_rows), per_rank)
        layers.append(
            _layer_from_rows(info, token_rows, experts, weight[start : start + n_rows], layer_logits)
        )
        start += n_rows
    return model, tokens, layers


_COLUMN_KINDS = {  # the columns the reader needs, by kind (`validate.arrow_kind`); the others are derived
    "stream": "string",
    "seq": "integer",
    "pos": "integer",
    "layer": "integer",
    "rank": "integer",
    "expert": "integer",
    "weight": "float",
}
_BYTES_PER_ROW = 96  # the needed columns as arrays, the stream codes and the per-layer views and checks


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
    info: dict[str, Any], token_rows: np.ndarray, experts: np.ndarray, weight: np.ndarray, logits: np.ndarray
) -> LayerRouting:
    """One layer's LayerRouting from its validated facts and arrays: experts [N, k], weight [N·k]."""
    n, k = info["num_tokens"], info["k"]
    bias = None if info["bias"] is None else np.asarray(info["bias"], dtype=np.float32)
    has_weights = info.get("has_weights", True)  # version 3 keys; versions 1-2 always had both and ranks
    weights = weight.reshape(n, k).copy() if has_weights else absent(n, k)
    return LayerRouting(
        layer=info["layer"],
        site=info["site"],
        token_rows=token_rows,
        logits=logits,
        experts=experts.astype(np.int64, copy=True),
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
