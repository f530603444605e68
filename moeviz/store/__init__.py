"""Routing at corpus scale: a Parquet store of many runs (models × checkpoints), DuckDB queries over it,
and checkpoint timelines. See README "Corpus store and checkpoints".

Writing: `write_corpus` (a corpus through one loaded model), `write_series` (every checkpoint of a
training run), `write_trace` (a Trace already in memory); the CLI's `moeviz trace` is `write_corpus` /
`write_series` from the shell. Reading: `StoreQuery`, `list_runs`, `validate_store`."""

from moeviz.corpus import iter_documents
from moeviz.store.checkpoints import write_series
from moeviz.store.layout import RunInfo, StoreError, list_runs, validate_store
from moeviz.store.plan import Batch, iter_batches
from moeviz.store.query import StoreQuery
from moeviz.store.writer import RUN_KEYWORDS, TraceSettings, write_corpus, write_trace

__all__ = [
    "RUN_KEYWORDS",
    "Batch",
    "RunInfo",
    "StoreError",
    "StoreQuery",
    "TraceSettings",
    "iter_batches",
    "iter_documents",
    "list_runs",
    "validate_store",
    "write_corpus",
    "write_series",
    "write_trace",
]

_RENAMED = {"trace_corpus": "write_corpus", "trace_series": "write_series"}


def __getattr__(name: str):
    """The 0.1 names of the writers (CHANGELOG.md), kept for one release with a DeprecationWarning."""
    if name not in _RENAMED:
        raise AttributeError(f"module 'moeviz.store' has no attribute {name!r}")
    import warnings

    warnings.warn(
        f"moeviz.store.{name} is deprecated: use moeviz.store.{_RENAMED[name]}",
        DeprecationWarning,
        stacklevel=2,
    )
    return globals()[_RENAMED[name]]
