"""Hostile trace and load-table files: each is refused with one TraceFormatError line naming what is wrong,
before anything large is allocated; a damaged file never reads back as different routing."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moeviz.errors import TraceFormatError
from moeviz.testing.scale_traces import synthetic_trace
from moeviz.trace import ExpertLoad, ModelInfo, Trace, validate
from tests.support.traces import assert_traces_equal


def _trace(num_tokens: int = 6) -> Trace:
    return synthetic_trace(
        num_experts=8, k=2, n_group=1, topk_group=1, num_blocks=3, first_dense=1, num_tokens=num_tokens
    )


def _rewrite(path: Path, *, meta=None, raw: bytes | None = None, table: pa.Table | None = None) -> None:
    """Rewrite a trace with other metadata (hashed as moeviz hashes it, so only the content is hostile) or
    another table."""
    table = pq.read_table(path) if table is None else table
    if raw is None:
        raw = json.dumps(meta).encode()
    keep = {k: v for k, v in (table.schema.metadata or {}).items() if not k.startswith(b"moeviz")}
    keep.update({validate.META_KEY: raw, validate.HASH_KEY: validate.metadata_hash(raw)})
    pq.write_table(table.replace_schema_metadata(keep), path)


def _meta(path: Path) -> dict:
    return json.loads(pq.read_schema(path).metadata[validate.META_KEY])


@pytest.fixture
def trace_file(tmp_path) -> Path:
    return _trace().to_parquet(tmp_path / "t.parquet")


def _edit(key_path: tuple, value):
    def apply(meta):
        node = meta
        for key in key_path[:-1]:
            node = node[key]
        node[key_path[-1]] = value
        return meta

    return apply


HOSTILE_METADATA = {
    "k zero": (_edit(("layers", 0, "k"), 0), r"layers\[0\]\.k: 0 is outside 1"),
    "k negative": (_edit(("layers", 0, "k"), -2), r"layers\[0\]\.k: -2 is outside"),
    "k above E": (_edit(("layers", 0, "k"), 9), r"layers\[0\]\.k: 9 is outside 1 … 8"),
    "a string for a number": (_edit(("layers", 0, "num_experts"), "8"), r"num_experts: expected an integer"),
    "a float for a number": (_edit(("layers", 0, "num_tokens"), 6.0), r"num_tokens: expected an integer"),
    "a bool for a number": (_edit(("model", "num_layers"), True), r"model\.num_layers: expected an integer"),
    "an unknown model key": (_edit(("model", "evil"), 1), r"model: unknown key\(s\) \['evil'\]"),
    "an unknown layer key": (_edit(("layers", 1, "evil"), 1), r"layers\[1\]: unknown key"),
    "a missing site": (
        lambda m: m["layers"][0].pop("site") and m,
        r"layers\[0\]: missing key\(s\) \['site'\]",
    ),
    "more tokens than the table": (_edit(("layers", 0, "num_tokens"), 7), r"num_tokens: 7 is outside 0 … 6"),
    "a short bias": (_edit(("layers", 0, "bias"), [0.0] * 3), r"bias: expected 8 numbers"),
    "an unknown score function": (
        _edit(("layers", 0, "score_fn"), "relu"),
        r"score_fn: 'relu' is not one of",
    ),
    "ragged token columns": (lambda m: m["tokens"]["pos"].pop() and m, r"tokens: columns are not lists"),
    "strings for token ids": (
        _edit(("tokens", "token_id"), ["1"] * 6),
        r"tokens\.token_id: expected integers",
    ),
    "a token twice": (_edit(("tokens", "pos"), [0] * 6), r"tokens: a \(stream, seq, pos\) appears twice"),
    "layers not a list": (_edit(("layers",), {"0": 1}), r"layers: expected a list"),
}


@pytest.mark.parametrize("case", list(HOSTILE_METADATA))
def test_hostile_metadata_is_refused_with_what_is_wrong(trace_file, case):
    edit, message = HOSTILE_METADATA[case]
    _rewrite(trace_file, meta=edit(_meta(trace_file)))
    with pytest.raises(TraceFormatError, match=message):
        Trace.from_parquet(trace_file)


@pytest.mark.parametrize(
    "raw, message",
    [
        (b"[1, 2, 3]", "a JSON list, not an object"),
        (b"{not json", "not valid JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),  # a RecursionError in json, not a traceback
        (b"\xff\xfe", "not valid JSON"),
    ],
)
def test_metadata_that_is_not_a_json_object_is_refused(trace_file, raw, message):
    _rewrite(trace_file, raw=raw)
    with pytest.raises(TraceFormatError, match=message):
        Trace.from_parquet(trace_file)


def test_a_changed_digit_in_the_metadata_fails_its_hash(trace_file):
    stored = pq.read_schema(trace_file).metadata
    raw = stored[validate.META_KEY].replace(b'"num_experts": 8', b'"num_experts": 9', 1)
    table = pq.read_table(trace_file)
    pq.write_table(table.replace_schema_metadata({**stored, validate.META_KEY: raw}), trace_file)
    with pytest.raises(TraceFormatError, match="does not match its SHA-256"):
        Trace.from_parquet(trace_file)
    pq.write_table(table.replace_schema_metadata({validate.META_KEY: raw}), trace_file)  # the hash removed
    with pytest.raises(TraceFormatError, match="SHA-256 of its metadata; it is missing"):
        Trace.from_parquet(trace_file)


def test_a_missing_column_and_a_wrong_type_are_refused(trace_file):
    table = pq.read_table(trace_file)
    _rewrite(trace_file, meta=_meta(trace_file), table=table.drop_columns(["expert"]))
    with pytest.raises(TraceFormatError, match="no 'expert' column"):
        Trace.from_parquet(trace_file)
    index = table.schema.get_field_index("expert")
    as_text = table.set_column(
        index, "expert", pa.array([str(v) for v in table.column("expert").to_pylist()])
    )
    _rewrite(trace_file, meta=_meta(trace_file), table=as_text)
    with pytest.raises(TraceFormatError, match="column 'expert': expected integer values, got string"):
        Trace.from_parquet(trace_file)


@pytest.mark.parametrize("bad_id, message", [(-5, "expert ids outside -1 … 7"), (1000, "expert ids outside")])
def test_expert_ids_outside_the_router_are_refused(trace_file, bad_id, message):
    table = pq.read_table(trace_file)
    experts = table.column("expert").to_numpy().copy()
    experts[3] = bad_id
    index = table.schema.get_field_index("expert")
    _rewrite(trace_file, meta=_meta(trace_file), table=table.set_column(index, "expert", pa.array(experts)))
    with pytest.raises(TraceFormatError, match=message):
        Trace.from_parquet(trace_file)


def test_rows_out_of_place_are_refused(trace_file):
    table = pq.read_table(trace_file)
    for column, message in (("rank", "ranks are not 0 … 1"), ("layer", "rows of another layer")):
        values = table.column(column).to_numpy().copy()
        values[2] += 1
        index = table.schema.get_field_index(column)
        _rewrite(trace_file, meta=_meta(trace_file), table=table.set_column(index, column, pa.array(values)))
        with pytest.raises(TraceFormatError, match=message):
            Trace.from_parquet(trace_file)
    pos = table.column("pos").to_numpy().copy()
    pos[1] += 1  # rank 1 of token 0 names another position than its rank 0
    index = table.schema.get_field_index("pos")
    _rewrite(trace_file, meta=_meta(trace_file), table=table.set_column(index, "pos", pa.array(pos)))
    with pytest.raises(TraceFormatError, match="a token's rows differ in pos"):
        Trace.from_parquet(trace_file)


def test_millions_of_null_rows_are_refused_from_the_footer_before_reading(trace_file, monkeypatch):
    rows = 2_000_000
    nulls = pa.table(
        {
            name: pa.nulls(rows, pq.read_schema(trace_file).field(name).type)
            for name in pq.read_schema(trace_file).names
        }
    )
    _rewrite(trace_file, meta=_meta(trace_file), table=nulls)
    assert trace_file.stat().st_size < 1_000_000  # small on disk, large in memory

    def no_read(*args, **kwargs):
        raise AssertionError("the data pages were read")

    monkeypatch.setattr(pq.ParquetFile, "read", no_read)
    with pytest.raises(TraceFormatError, match=f"holds {rows} rows, its metadata describes 24"):
        Trace.from_parquet(trace_file)


def test_a_read_larger_than_the_memory_budget_is_refused(trace_file, monkeypatch):
    monkeypatch.setattr(validate, "memory_budget", lambda: 1000)
    with pytest.raises(TraceFormatError, match=r"needs ≈ 0\.0 GiB, more than the 0\.0 GiB allowed"):
        Trace.from_parquet(trace_file)


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "pipe.parquet"
    os.mkfifo(fifo)
    with pytest.raises(TraceFormatError, match="not a regular file"):
        Trace.from_parquet(fifo)


def test_single_bit_flips_never_read_back_as_different_routing(tmp_path):
    """Every flip is either refused or harmless (it hit bytes the reader does not use, e.g. statistics)."""
    original = _trace(num_tokens=40)
    path = original.to_parquet(tmp_path / "t.parquet")
    data = bytearray(path.read_bytes())
    rng = np.random.default_rng(0)
    outcomes = {"refused": 0, "same": 0}
    for offset in rng.choice(len(data), size=40, replace=False):
        flipped = bytearray(data)
        flipped[offset] ^= 1 << int(rng.integers(8))
        damaged = tmp_path / f"flip{offset}.parquet"
        damaged.write_bytes(bytes(flipped))
        try:
            read = Trace.from_parquet(damaged)
        except TraceFormatError:
            outcomes["refused"] += 1
            continue
        assert_traces_equal(original, read)
        outcomes["same"] += 1
    assert outcomes["refused"] >= 10, outcomes  # most bytes are data pages and metadata: checked


def _load(tmp_path) -> Path:
    counts = np.arange(2 * 3 * 4, dtype=np.int64).reshape(2, 3, 4)
    model = ModelInfo(source="s", model_type="m", architecture="a", num_layers=3)
    return ExpertLoad(model=model, counts=counts, layers=[0, 1, 2], top_k=2, source="sglang-dump").to_parquet(
        tmp_path / "load.parquet"
    )


def test_a_load_table_round_trips_and_hostile_ones_are_refused(tmp_path):
    path = _load(tmp_path)
    read = ExpertLoad.from_parquet(path)
    np.testing.assert_array_equal(read.counts, np.arange(24).reshape(2, 3, 4))
    meta = _meta(path)
    for edit, message in (
        (_edit(("num_experts",), 5), "holds 24 rows, its metadata describes 30"),
        (_edit(("top_k",), 0), r"top_k: 0 is outside 1 … 4"),
        (_edit(("layers",), ["0", 1, 2]), r"layers\[0\]: expected an integer"),
        (_edit(("model", "x"), 1), "model: unknown key"),
    ):
        _rewrite(path, meta=edit(json.loads(json.dumps(meta))))
        with pytest.raises(TraceFormatError, match=message):
            ExpertLoad.from_parquet(path)
    table = pq.read_table(path)
    negative = table.set_column(
        table.schema.get_field_index("count"), "count", pa.array(-table.column("count").to_numpy())
    )
    _rewrite(path, meta=meta, table=negative)
    with pytest.raises(TraceFormatError, match="a negative count"):
        ExpertLoad.from_parquet(path)
