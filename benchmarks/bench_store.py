"""Store benchmark: bytes per routed token per layer, 10M-row aggregation. (Tracing throughput against a
plain forward: benchmarks/bench_trace_throughput.py.)

Run: .venv/bin/python benchmarks/bench_store.py
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from record import Figure, record

import moeviz
from moeviz.samples import eval_dir
from moeviz.store import StoreQuery, TraceSettings, write_corpus
from moeviz.store.layout import append_manifest
from moeviz.store.schema import store_schema
from moeviz.store.writer import finish_run, prepare_run
from moeviz.testing.scale_traces import SYNTHETIC_RUN

BATCHES, BATCH, CHUNK = 12, 8, 256
COMMAND = "python benchmarks/bench_store.py"


def storage(loaded, store: Path, num_batches: int = BATCHES) -> Figure:
    """Bytes the store keeps per routed token and layer (the throughput is bench_trace_throughput.py's)."""
    run = write_corpus(
        loaded, eval_dir(), store, settings=TraceSettings(BATCH, CHUNK, num_batches), progress=False
    )
    layers = len(run.config["layers"])
    e = run.config["layers"][0]["num_experts"]
    stored = sum(int(p["bytes"]) for p in run.parts.values()) / (run.tokens * layers)
    print(
        f"{loaded.info.source}: {stored:.1f} bytes per routed token per layer (all columns, zstd) vs {4 * e} "
        f"bytes for full fp32 router logits alone (E = {e}); ratio {stored / (4 * e):.2f}"
    )
    return Figure(
        "Store and tracing",
        f"bytes per routed token per layer (all columns, zstd), {loaded.info.source}, "
        f"{num_batches} batches of {BATCH} × {CHUNK} tokens",
        f"{stored:.1f} bytes (fp32 router logits alone at E = {e}: {4 * e} bytes; "
        f"ratio {stored / (4 * e):.2f})",
        COMMAND,
    )


def aggregation(root: Path, rows: int = 10_000_000) -> Figure:
    rng = np.random.default_rng(0)
    folder, _ = prepare_run(root, "synthetic", "final", dict(SYNTHETIC_RUN), resume=False)
    per_part = 1_000_000
    for i in range(rows // per_part):
        n = per_part
        columns = {
            "model": pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int32)), pa.array(["synthetic"])),
            "checkpoint": pa.DictionaryArray.from_arrays(
                pa.array(np.zeros(n, np.int32)), pa.array(["final"])
            ),
            "batch": pa.array(np.full(n, i, np.int32)),
            "doc": pa.array(np.zeros(n, np.int32)),
            "domain": pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int32)), pa.array([""])),
            "seq": pa.array(np.arange(n, dtype=np.int64) // 512 + i * 10_000),
            "pos": pa.array((np.arange(n) // 16 % 512).astype(np.int32)),
            "token_id": pa.array(rng.integers(0, 32000, n).astype(np.int32)),
            "layer": pa.array((np.arange(n) // 2 % 8).astype(np.int16)),
            "site": pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int32)), pa.array(["mlp"])),
            "rank": pa.array((np.arange(n) % 2).astype(np.int8)),
            "expert": pa.array(rng.integers(0, 64, n).astype(np.int16)),
            "weight": pa.array(rng.random(n, dtype=np.float32)),
            "score": pa.array(rng.random(n, dtype=np.float32)),
            "lse": pa.array(rng.random(n, dtype=np.float32)),
        }
        table = pa.Table.from_pydict(columns, schema=store_schema())
        name = f"part-{i:06d}.parquet"
        pq.write_table(table, folder / name, compression="zstd")
        size = (folder / name).stat().st_size
        entry = {"batch": i, "file": name, "rows": n, "bytes": size, "tokens": n // 16, "token_hash": ""}
        append_manifest(folder / "manifest.jsonl", entry)
    finish_run(folder, rows // per_part)
    start = time.perf_counter()
    query = StoreQuery(root)
    frame = query.sql("SELECT layer, expert, count(*) AS n FROM rows WHERE expert >= 0 GROUP BY ALL")
    elapsed = time.perf_counter() - start
    print(
        f"{rows:,} rows aggregated per layer x expert ({len(frame)} groups) in {elapsed:.2f}s (target < 3 s)"
    )
    return Figure(
        "Store and tracing",
        f"{rows:,} rows aggregated per layer × expert (wall, one run)",
        f"{elapsed:.2f} s",
        COMMAND,
        "< 3 s",
        elapsed < 3,
    )


def main() -> None:
    loaded = moeviz.load_model("sample:mixtral-healthy")
    with tempfile.TemporaryDirectory() as tmp:
        figures = [storage(loaded, Path(tmp) / "store"), aggregation(Path(tmp) / "big")]
    record("store", figures)


if __name__ == "__main__":
    main()
