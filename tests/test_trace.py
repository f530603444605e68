"""The Trace: the routing frame's schema and values, and the Parquet round trip."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import moeviz
from moeviz.errors import TraceFormatError
from moeviz.trace import ROUTING_COLUMNS, Trace

REQUIRED = ["seq", "pos", "token_id", "token", "layer", "rank", "expert", "weight", "score"]


def _assert_traces_equal(a: Trace, b: Trace) -> None:
    pd.testing.assert_frame_equal(a.tokens, b.tokens)
    assert a.model == b.model
    assert len(a.layers) == len(b.layers)
    for x, y in zip(a.layers, b.layers, strict=True):
        for name in ("token_rows", "logits", "scores", "selection_scores", "experts", "weights"):
            np.testing.assert_array_equal(getattr(x, name), getattr(y, name), err_msg=name)
        assert (x.layer, x.site, x.score_fn, x.decision_source, x.top_k, x.capacity) == (
            y.layer,
            y.site,
            y.score_fn,
            y.decision_source,
            y.top_k,
            y.capacity,
        )
        if x.bias is None:
            assert y.bias is None
        else:
            np.testing.assert_array_equal(x.bias, y.bias)


@pytest.mark.parametrize("family", ["deepseek_v3", "switch_transformers", "jetmoe"])
def test_parquet_round_trip(tiny_model_dir, tmp_path, family):
    loaded = moeviz.load_model(
        tiny_model_dir(family, **({"expert_capacity": 2} if family == "switch_transformers" else {}))
    )
    trace = moeviz.capture(loaded, token_ids=[[5, 6, 7, 8, 9], [10, 11]], generate=2)
    path = trace.to_parquet(tmp_path / "t.parquet")
    _assert_traces_equal(trace, Trace.from_parquet(path))
    assert not list(tmp_path.glob(".*partial"))


def test_routing_frame_schema_and_values(tiny_model_dir):
    loaded = moeviz.load_model(tiny_model_dir("deepseek_v3"))
    trace = moeviz.capture(loaded, token_ids=[[5, 6, 7, 8], [9, 10, 11]])
    frame = trace.routing_frame()
    assert list(frame.columns) == ROUTING_COLUMNS and set(REQUIRED) <= set(frame.columns)
    layers = [r.layer for r in trace.layers]
    assert len(frame) == 7 * len(layers) * 2
    assert not frame.duplicated(["seq", "pos", "layer", "rank"]).any()
    # Rank 0 holds the largest weight.
    wide = frame.pivot_table(index=["seq", "pos", "layer"], columns="rank", values="weight")
    assert (wide[0] >= wide[1]).all()
    # score is the sigmoid of that expert's raw logit (deepseek_v3 scores with sigmoid), before renorm.
    np.testing.assert_allclose(frame.score, 1 / (1 + np.exp(-frame.logit.astype(np.float64))), rtol=1e-6)
    # Selection score includes the balancing bias, the score does not.
    routing = trace.layers[0]
    sel = frame[frame.layer == routing.layer]
    np.testing.assert_allclose(sel.selection_score - sel.score, routing.bias[sel.expert], atol=1e-6)
    # Weights sum to routed_scaling_factor (deepseek_v3 renormalises, then scales).
    sums = frame.groupby(["seq", "pos", "layer"]).weight.sum()
    np.testing.assert_allclose(sums, loaded.model.config.routed_scaling_factor, rtol=1e-5)


def test_dropped_tokens_are_minus_one_with_zero_weight(tiny_model_dir):
    loaded = moeviz.load_model(tiny_model_dir("switch_transformers", expert_capacity=1))
    frame = moeviz.capture(loaded, token_ids=[[5, 6, 7, 8, 9, 10, 11, 12]]).routing_frame()
    dropped = frame[frame.expert == -1]
    assert len(dropped) > 0
    assert (dropped.weight == 0).all() and dropped.score.isna().all()
    kept = frame[frame.expert >= 0]
    # Capacity 1: each expert takes at most one token per sequence per layer.
    assert kept.groupby(["site", "layer", "seq", "expert"]).size().max() == 1


def test_scores_frame_matches_layer(sample_model):
    trace = moeviz.capture(sample_model, "one two three")
    routing = trace.layers[2]
    frame = trace.scores_frame(routing.layer)
    assert len(frame) == len(routing.token_rows) * routing.num_experts
    dispatched = frame[frame.dispatched].sort_values(["row", "weight"], ascending=[True, False])
    np.testing.assert_array_equal(dispatched.expert.to_numpy().reshape(-1, routing.k), routing.experts)


def test_foreign_parquet_is_rejected(tmp_path):
    path = tmp_path / "other.parquet"
    pq.write_table(pa.table({"a": [1, 2]}), path)
    with pytest.raises(TraceFormatError, match="not a moeviz trace"):
        Trace.from_parquet(path)
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not parquet at all")
    with pytest.raises(TraceFormatError, match="not a readable Parquet"):
        Trace.from_parquet(junk)


def test_concat_equals_one_batched_capture(tiny_model_dir):
    loaded = moeviz.load_model(tiny_model_dir("qwen3_moe"))
    seqs = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    whole = moeviz.capture(loaded, token_ids=seqs)
    halves = [moeviz.capture(loaded, token_ids=seqs[:2]), moeviz.capture(loaded, token_ids=seqs[2:])]
    parts = Trace.concat(halves)
    key = ["seq", "pos"]
    pd.testing.assert_frame_equal(
        parts.routing_frame().sort_values([*key, "layer", "rank"]).reset_index(drop=True),
        whole.routing_frame().sort_values([*key, "layer", "rank"]).reset_index(drop=True),
        atol=1e-5,
    )


# ---- Parquet format version 2: each token's logits once, on its rank-0 row ------------------------------
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


def test_version_2_keeps_each_tokens_logits_once_and_reads_version_1(tmp_path):
    from moeviz.testing.scale_traces import synthetic_trace

    trace = synthetic_trace(
        num_experts=64, k=8, n_group=4, topk_group=2, num_blocks=3, first_dense=1, num_tokens=2000
    )
    v2, v1 = tmp_path / "v2.parquet", tmp_path / "v1.parquet"
    trace.to_parquet(v2)
    _write_v1(trace, v1)
    table = pq.read_table(v2)
    assert json_format(table) == "moeviz.trace/2"
    logits = table.column("logits").combine_chunks()
    rank = table.column("rank").to_numpy()
    np.testing.assert_array_equal(logits.is_null().to_numpy(zero_copy_only=False), rank > 0)
    _assert_traces_equal(trace, Trace.from_parquet(v2))
    _assert_traces_equal(trace, Trace.from_parquet(v1))
    (raw1, packed1), (raw2, packed2) = _logits_bytes(v1), _logits_bytes(v2)
    k = trace.layers[0].k
    # k copies of every token's logits in version 1, one in version 2 (plus the null bitmap and offsets);
    # version 1's dictionary encoding folds some of the copies, zstd more of them
    assert raw1 / raw2 > 0.6 * k, (raw1, raw2)
    assert packed2 < packed1, (packed1, packed2)


def json_format(table: pa.Table) -> str:
    import json

    return json.loads(table.schema.metadata[b"moeviz"])["format"]


def test_unknown_format_version_is_refused(tmp_path):
    from moeviz.testing.scale_traces import synthetic_trace

    path = synthetic_trace(
        num_experts=8, k=2, n_group=1, topk_group=1, num_blocks=2, first_dense=1, num_tokens=5
    ).to_parquet(tmp_path / "t.parquet")
    table = pq.read_table(path)
    meta = table.schema.metadata[b"moeviz"].replace(b"moeviz.trace/2", b"moeviz.trace/99")
    pq.write_table(table.replace_schema_metadata({b"moeviz": meta}), path)
    with pytest.raises(TraceFormatError, match=r"moeviz\.trace/99"):
        Trace.from_parquet(path)


# ---- scores and selection scores derive from the logits ---------------------------------------------------
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


def test_capture_builds_the_token_table_on_first_use(sample_model):
    """The token table (and its decoded strings) is built when first read; a pickle carries it built."""
    import pickle

    trace = moeviz.capture(sample_model, "one two three")
    assert "_tokens" in trace.__dict__ and not isinstance(trace.__dict__["_tokens"], pd.DataFrame)  # lazy
    copy = pickle.loads(pickle.dumps(trace))  # builds the token table
    pd.testing.assert_frame_equal(copy.tokens, trace.tokens)
    assert list(trace.tokens["token"]) == sample_model.token_texts(trace.tokens["token_id"].tolist())
