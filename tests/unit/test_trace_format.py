"""The Trace's Parquet format and derived arrays on synthetic traces (no model): foreign files are refused,
the format keeps each token's logits once and reads versions 1 and 2, unknown versions are refused, and the
scores derive from the logits. Round trips of real captures: tests/models/test_trace.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moeviz.errors import TraceFormatError
from moeviz.trace import TRACE_FORMAT, Trace
from tests.support.traces import assert_traces_equal


def test_foreign_parquet_is_rejected(tmp_path):
    path = tmp_path / "other.parquet"
    pq.write_table(pa.table({"a": [1, 2]}), path)
    with pytest.raises(TraceFormatError, match=r"no .moeviz. metadata"):
        Trace.from_parquet(path)
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not parquet at all")
    with pytest.raises(TraceFormatError, match="not a readable Parquet"):
        Trace.from_parquet(junk)


def _write_v1(trace: Trace, path) -> None:
    """The version-1 writer (as moeviz wrote it before version 2): every routing row carries its token's
    full logits, so each token's logits appear k times."""
    import json
    from dataclasses import asdict

    from moeviz.trace import TOKEN_COLUMNS
    from moeviz.trace.parquet import _layer_meta

    table = pa.Table.from_pandas(trace.routing_frame(), preserve_index=False)
    logits = [np.repeat(r.logits.astype(np.float32), r.k, axis=0) for r in trace.layers]
    lengths = np.concatenate([np.full(len(b), b.shape[1]) for b in logits])
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    column = pa.ListArray.from_arrays(
        pa.array(offsets), pa.array(np.concatenate([b.reshape(-1) for b in logits]))
    )
    meta = {
        "format": "moeviz.trace/1",
        "model": asdict(trace.model),
        "tokens": {c: trace.tokens[c].tolist() for c in TOKEN_COLUMNS},
        "layers": [_layer_meta(r) for r in trace.layers],
    }
    table = table.append_column("logits", column)
    pq.write_table(table.replace_schema_metadata({b"moeviz": json.dumps(meta)}), path, compression="zstd")


def _logits_bytes(path) -> tuple[int, int]:
    """(uncompressed, compressed) bytes of the `logits` column over the file's row groups."""
    meta = pq.ParquetFile(path).metadata
    sizes = [
        (col.total_uncompressed_size, col.total_compressed_size)
        for g in range(meta.num_row_groups)
        for col in (meta.row_group(g).column(c) for c in range(meta.num_columns))
        if col.path_in_schema.startswith("logits")
    ]
    return sum(s[0] for s in sizes), sum(s[1] for s in sizes)


def test_the_format_keeps_each_tokens_logits_once_and_reads_versions_1_and_2(tmp_path):
    from moeviz.testing.scale_traces import synthetic_trace

    trace = synthetic_trace(
        num_experts=64, k=8, n_group=4, topk_group=2, num_blocks=3, first_dense=1, num_tokens=2000
    )
    v3, v2, v1 = tmp_path / "v3.parquet", tmp_path / "v2.parquet", tmp_path / "v1.parquet"
    trace.to_parquet(v3)
    _write_v2(v3, v2)
    _write_v1(trace, v1)
    table = pq.read_table(v3)
    assert json_format(table) == TRACE_FORMAT
    logits = table.column("logits").combine_chunks()
    rank = table.column("rank").to_numpy()
    np.testing.assert_array_equal(logits.is_null().to_numpy(zero_copy_only=False), rank > 0)
    assert_traces_equal(trace, Trace.from_parquet(v3))
    assert_traces_equal(trace, Trace.from_parquet(v2))
    assert_traces_equal(trace, Trace.from_parquet(v1))
    (raw1, packed1), (raw2, packed2) = _logits_bytes(v1), _logits_bytes(v3)
    k = trace.layers[0].k
    # k copies of every token's logits in version 1, one since version 2 (plus the null bitmap and offsets);
    # version 1's dictionary encoding folds some of the copies, zstd more of them
    assert raw1 / raw2 > 0.6 * k, (raw1, raw2)
    assert packed2 < packed1, (packed1, packed2)


def _write_v2(v3: Path, v2: Path) -> None:
    """A version-2 file: version 3 without the layers' has_logits / has_weights / ranked keys."""
    import json

    table = pq.read_table(v3)
    meta = json.loads(table.schema.metadata[b"moeviz"])
    meta["format"] = "moeviz.trace/2"
    for layer in meta["layers"]:
        for key in ("has_logits", "has_weights", "ranked"):
            del layer[key]
    pq.write_table(table.replace_schema_metadata({b"moeviz": json.dumps(meta)}), v2)


def json_format(table: pa.Table) -> str:
    import json

    return json.loads(table.schema.metadata[b"moeviz"])["format"]


def test_unknown_format_version_is_refused(tmp_path):
    from moeviz.testing.scale_traces import synthetic_trace

    path = synthetic_trace(
        num_experts=8, k=2, n_group=1, topk_group=1, num_blocks=2, first_dense=1, num_tokens=5
    ).to_parquet(tmp_path / "t.parquet")
    table = pq.read_table(path)
    meta = table.schema.metadata[b"moeviz"].replace(TRACE_FORMAT.encode(), b"moeviz.trace/99")
    pq.write_table(table.replace_schema_metadata({b"moeviz": meta}), path)
    with pytest.raises(TraceFormatError, match=r"moeviz\.trace/99"):
        Trace.from_parquet(path)


def test_scores_are_derived_from_the_logits_and_follow_replace():
    import dataclasses

    from moeviz.scoring import scores_from_logits, selection_scores
    from moeviz.testing.scale_traces import synthetic_trace

    routing = synthetic_trace(
        num_experts=16, k=2, n_group=4, topk_group=2, num_blocks=2, first_dense=1, num_tokens=20
    ).layers[0]
    np.testing.assert_array_equal(routing.scores, scores_from_logits(routing.logits, "sigmoid"))
    np.testing.assert_array_equal(routing.selection_scores, routing.scores + routing.bias)
    assert routing.scores is routing.scores  # computed once
    with pytest.raises(AttributeError):
        routing.scores = routing.logits  # read-only
    moved = dataclasses.replace(routing, logits=routing.logits + 1, score_fn="softmax", bias=None)
    np.testing.assert_array_equal(moved.scores, scores_from_logits(routing.logits + 1, "softmax"))
    np.testing.assert_array_equal(moved.selection_scores, moved.scores)
    import pickle

    assert pickle.loads(pickle.dumps(routing))._derived == {}  # a pickle carries the logits only
    routing.bias = None  # reassigning a field refreshes what derives from it
    np.testing.assert_array_equal(routing.selection_scores, routing.scores)
    np.testing.assert_array_equal(selection_scores(routing.scores, None), routing.selection_scores)


def test_version_4_keeps_the_new_family_facts_and_version_3_reads_without_them(tmp_path):
    import dataclasses
    import json

    from moeviz.testing.scale_traces import synthetic_trace

    trace = synthetic_trace(
        num_experts=8, k=2, n_group=1, topk_group=1, num_blocks=3, first_dense=0, num_tokens=20
    )
    first, second, third = trace.layers
    layers = [
        dataclasses.replace(first, zero_experts=2),
        dataclasses.replace(second, hash_routed=True, loop_pass=1),
        dataclasses.replace(third, bias=np.ones(8, np.float32), bias_on="logits"),
    ]
    model = dataclasses.replace(trace.model, language_model="model.language_model (DeepseekV3Model)")
    trace = dataclasses.replace(trace, layers=layers, model=model)
    v4, v3 = tmp_path / "v4.parquet", tmp_path / "v3.parquet"
    trace.to_parquet(v4)
    back = Trace.from_parquet(v4)
    assert back.model.language_model == "model.language_model (DeepseekV3Model)"
    got = [(r.zero_experts, r.hash_routed, r.loop_pass, r.bias_on) for r in back.layers]
    assert got == [(2, False, 0, "scores"), (0, True, 1, "scores"), (0, False, 0, "logits")]
    assert back.layers[0].routed_experts == 6
    # selection on the raw logits + bias where the bias is on the logits (Kolibri-1)
    np.testing.assert_array_equal(back.layers[2].selection_scores, back.layers[2].logits + np.float32(1))

    table = pq.read_table(v4)
    meta = json.loads(table.schema.metadata[b"moeviz"])
    meta["format"] = "moeviz.trace/3"
    del meta["model"]["language_model"]
    for layer in meta["layers"]:
        for key in ("zero_experts", "hash_routed", "bias_on", "loop_pass"):
            del layer[key]
    pq.write_table(table.replace_schema_metadata({b"moeviz": json.dumps(meta)}), v3)
    old = Trace.from_parquet(v3)
    assert old.model.language_model == ""
    assert [(r.zero_experts, r.hash_routed, r.loop_pass, r.bias_on) for r in old.layers] == [
        (0, False, 0, "scores")
    ] * 3
