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

from collections.abc import Sequence

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


def _constant(value: str, n: int) -> pa.DictionaryArray:
    return pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int32)), pa.array([value]))


def _rank0_only(values: np.ndarray, k: int) -> pa.Array:
    """[N] per-token values → [N·k] with the value on the rank-0 row and null on the others."""
    out = np.zeros(len(values) * k, np.float32)
    out[::k] = values
    mask = np.ones(len(out), bool)
    mask[::k] = False
    return pa.array(out, type=pa.float32(), mask=mask)


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
) -> pa.Table:
    """Rows of one captured batch. `seq_docs[i]` / `seq_domains[i]`: document and domain of the batch's
    sequence i (trace seq i); rows are numbered seq_offset + i. Output: Σ_layers N_ℓ·k_ℓ rows."""
    tokens = trace.tokens
    t_seq = tokens["seq"].to_numpy().astype(np.int64)
    t_pos = tokens["pos"].to_numpy().astype(np.int32)
    t_id = tokens["token_id"].to_numpy().astype(np.int32)
    domain_names, domain_codes = np.unique(np.asarray(seq_domains, dtype=object), return_inverse=True)
    docs = np.asarray(seq_docs, dtype=np.int32)
    parts = []
    for routing in trace.layers:
        n, k = routing.experts.shape
        rows = np.repeat(routing.token_rows, k)
        experts = routing.experts.reshape(-1)
        valid = experts >= 0
        picked = routing.scores[np.repeat(np.arange(n), k), np.where(valid, experts, 0)]
        seqs = t_seq[rows]
        columns = {
            "model": _constant(model, n * k),
            "checkpoint": _constant(checkpoint, n * k),
            "batch": pa.array(np.full(n * k, batch, np.int32)),
            "doc": pa.array(docs[seqs]),
            "domain": pa.DictionaryArray.from_arrays(
                pa.array(domain_codes[seqs].astype(np.int32)), pa.array(domain_names.astype(str))
            ),
            "seq": pa.array(seqs + seq_offset),
            "pos": pa.array(t_pos[rows]),
            "token_id": pa.array(t_id[rows]),
            "layer": pa.array(np.full(n * k, routing.layer, np.int16)),
            "site": _constant(routing.site, n * k),
            "rank": pa.array(np.tile(np.arange(k, dtype=np.int8), n)),
            "expert": pa.array(experts.astype(np.int16)),
            "weight": pa.array(routing.weights.reshape(-1).astype(np.float32)),
            "score": pa.array(np.where(valid, picked, np.nan).astype(np.float32)),
            "lse": _rank0_only(logsumexp_rows(routing.logits), k),
        }
        if confidence:
            from moeviz.analysis.confidence import layer_confidence

            conf = layer_confidence(routing)
            columns["entropy"] = _rank0_only(conf.entropy, k)
            columns["margin"] = _rank0_only(conf.margin, k)
        parts.append(pa.Table.from_pydict(columns, schema=store_schema(confidence)))
    if not parts:
        return store_schema(confidence).empty_table()
    return pa.concat_tables(parts, promote_options="permissive").combine_chunks()
