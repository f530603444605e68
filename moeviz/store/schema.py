"""The store's row schema: one row per (token, MoE layer, rank), flat columns, built straight from numpy.

| column | type | meaning |
|---|---|---|
| model, checkpoint | dictionary<string> | run labels (also the folder names) |
| batch | int32 | batch index in the run's fixed plan |
| doc | int32 | document index in the corpus (reading order) |
| domain | dictionary<string> | the document's domain ("" when the corpus has none) |
| seq | int64 | sequence index in the run (global, in plan order) |
| pos | int32 | position within the sequence |
| token_id | int32 | input token id |
| layer | int16 | MoE layer index |
| site | dictionary<string> | "mlp", or "encoder"/"decoder" for encoder-decoders |
| rank | int8 | slot, by descending weight (0 = top-1) |
| expert | int16 | dispatched expert, -1 = slot dropped by capacity |
| weight | float32 | combination weight the model applied (0 for a dropped slot) |
| score | float32 | router score of that expert (NaN for a dropped slot) |
| lse | float32 | log Σ_e exp(router logit), the z-loss term; on rank-0 rows only (null elsewhere) |
| entropy, margin | float32 | optional (`confidence=True`): router entropy (nats), top-k margin; rank 0 |

Full router logits are not stored: R = k rows per token and layer instead of E floats; see
benchmarks/bench_store.py for bytes per routed token per layer against full fp32 logits.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import pyarrow as pa

from moeviz.analysis.losses import logsumexp_rows
from moeviz.trace import Trace

SCHEMA_TAG = "rows/1"

_DICT = pa.dictionary(pa.int32(), pa.string())
BASE_FIELDS = [
    pa.field("model", _DICT),
    pa.field("checkpoint", _DICT),
    pa.field("batch", pa.int32()),
    pa.field("doc", pa.int32()),
    pa.field("domain", _DICT),
    pa.field("seq", pa.int64()),
    pa.field("pos", pa.int32()),
    pa.field("token_id", pa.int32()),
    pa.field("layer", pa.int16()),
    pa.field("site", _DICT),
    pa.field("rank", pa.int8()),
    pa.field("expert", pa.int16()),
    pa.field("weight", pa.float32()),
    pa.field("score", pa.float32()),
    pa.field("lse", pa.float32()),
]
CONFIDENCE_FIELDS = [pa.field("entropy", pa.float32()), pa.field("margin", pa.float32())]


def store_schema(confidence: bool = False) -> pa.Schema:
    fields = BASE_FIELDS + (CONFIDENCE_FIELDS if confidence else [])
    return pa.schema(fields, metadata={b"moeviz.store": SCHEMA_TAG.encode()})


def _dictionary(codes: np.ndarray, values: Iterable[str]) -> pa.DictionaryArray:
    return pa.DictionaryArray.from_arrays(
        pa.array(codes, type=pa.int32()), pa.array(list(values), pa.string())
    )


def _rank0_only(values: np.ndarray, k: np.ndarray) -> pa.Array:
    """[N] per-token values → [Σ k] with the value on each token's rank-0 row and null on the others
    (`k` [N]: slots of each token's layer)."""
    out = np.zeros(int(k.sum()), np.float32)
    first = np.cumsum(k) - k
    out[first] = values
    mask = np.ones(len(out), bool)
    mask[first] = False
    return pa.array(out, type=pa.float32(), mask=mask)


def input_token_columns(
    token_ids: Sequence[Sequence[int]], layers: Sequence
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(seq, pos, token_id) of every row of the token table of a one-forward capture on `token_ids`, without
    building that table: the input stream's tokens in sequence order, each sequence's from position 0 (what
    `capture` records for token ids: right padding, padding excluded). None when `layers` route anything but
    the input stream (an encoder-decoder's decoder): then the token table is the reference."""
    lengths = np.fromiter((len(seq) for seq in token_ids), np.int64, len(token_ids))
    total = int(lengths.sum())
    if any(r.site != "mlp" or (len(r.token_rows) and int(r.token_rows.max()) >= total) for r in layers):
        return None
    seq = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    starts = np.cumsum(lengths) - lengths
    pos = (np.arange(total, dtype=np.int64) - np.repeat(starts, lengths)).astype(np.int32)
    ids = np.fromiter((i for s in token_ids for i in s), np.int32, total)
    return seq, pos, ids


def trace_table(
    trace: Trace,
    *,
    model: str,
    checkpoint: str,
    batch: int,
    seq_offset: int,
    seq_docs: Sequence[int],
    seq_domains: Sequence[str],
    confidence: bool = False,
    token_ids: Sequence[Sequence[int]] | None = None,
) -> pa.Table:
    """Rows of one captured batch. `seq_docs[i]` / `seq_domains[i]`: document and domain of the batch's
    sequence i (trace seq i); rows are numbered seq_offset + i. Output: Σ_layers N_ℓ·k_ℓ rows, layer by
    layer, each token's k rows by rank; one chunk per column, built from numpy for all layers at once.

    `token_ids`: the ids the trace was captured on (`capture(loaded, token_ids=...)`, no generation). Given,
    the rows' seq, pos and token_id come from them (`input_token_columns`) instead of `trace.tokens`, whose
    token strings the store does not keep."""
    schema = store_schema(confidence)
    layers = trace.layers
    if not layers:
        return schema.empty_table()
    columns_of = input_token_columns(token_ids, layers) if token_ids is not None else None
    if columns_of is None:
        tokens = trace.tokens
        columns_of = (
            tokens["seq"].to_numpy().astype(np.int64, copy=False),
            tokens["pos"].to_numpy().astype(np.int32),
            tokens["token_id"].to_numpy().astype(np.int32),
        )
    t_seq, t_pos, t_id = columns_of
    domain_names, domain_codes = np.unique(np.asarray(seq_domains, dtype=object), return_inverse=True)
    docs = np.asarray(seq_docs, dtype=np.int32)
    sites = list(dict.fromkeys(r.site for r in layers))
    rows, ranks, experts, weights, scores, lse = [], [], [], [], [], []
    layer_col, site_col, token_k = [], [], []
    entropy, margin = [], []
    for routing in layers:
        n, k = routing.experts.shape
        picked_experts = routing.experts.astype(np.int16)
        valid = picked_experts >= 0
        picked = np.take_along_axis(routing.scores, np.where(valid, picked_experts, 0).astype(np.intp), 1)
        rows.append(np.repeat(routing.token_rows, k))
        ranks.append(np.tile(np.arange(k, dtype=np.int8), n))
        experts.append(picked_experts.reshape(-1))
        weights.append(routing.weights.astype(np.float32, copy=False).reshape(-1))
        scores.append(np.where(valid, picked, np.nan).astype(np.float32).reshape(-1))
        lse.append(logsumexp_rows(routing.logits))
        layer_col.append(np.full(n * k, routing.layer, np.int16))
        site_col.append(np.full(n * k, sites.index(routing.site), np.int32))
        token_k.append(np.full(n, k, np.int64))
        if confidence:
            from moeviz.analysis.confidence import layer_confidence

            conf = layer_confidence(routing)
            entropy.append(conf.entropy)
            margin.append(conf.margin)
    row = np.concatenate(rows)
    token_k_all = np.concatenate(token_k)
    seqs = t_seq[row]
    total = len(row)
    zeros = np.zeros(total, np.int32)
    columns = [
        _dictionary(zeros, [model]),
        _dictionary(zeros, [checkpoint]),
        pa.array(np.full(total, batch, np.int32)),
        pa.array(docs[seqs]),
        _dictionary(domain_codes[seqs].astype(np.int32), domain_names.astype(str)),
        pa.array(seqs + seq_offset),
        pa.array(t_pos[row]),
        pa.array(t_id[row]),
        pa.array(np.concatenate(layer_col)),
        _dictionary(np.concatenate(site_col), sites),
        pa.array(np.concatenate(ranks)),
        pa.array(np.concatenate(experts)),
        pa.array(np.concatenate(weights)),
        pa.array(np.concatenate(scores)),
        _rank0_only(np.concatenate(lse), token_k_all),
    ]
    if confidence:
        columns.append(_rank0_only(np.concatenate(entropy).astype(np.float32), token_k_all))
        columns.append(_rank0_only(np.concatenate(margin).astype(np.float32), token_k_all))
    return pa.Table.from_arrays(columns, schema=schema)
