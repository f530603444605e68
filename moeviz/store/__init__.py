"""Routing at corpus scale: a Parquet store of many runs (models × checkpoints), DuckDB queries over it,
and checkpoint timelines. See README "Corpus store and checkpoints"."""

from moeviz.corpus import iter_documents
from moeviz.store.layout import RunInfo, StoreError, list_runs, validate_store
from moeviz.store.plan import Batch, iter_batches
from moeviz.store.query import StoreQuery
from moeviz.store.writer import TraceSettings, trace_corpus

__all__ = [
    "Batch",
    "RunInfo",
    "StoreError",
    "StoreQuery",
    "TraceSettings",
    "iter_batches",
    "iter_documents",
    "list_runs",
    "trace_corpus",
    "validate_store",
]
