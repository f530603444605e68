"""The Trace data model: tokens plus the routing of every MoE layer over them (no torch).

`records` holds its parts (`ModelInfo`, `LayerRouting`, `LazyTokens`, the table columns), `model` the
`Trace` and its frames, `parquet` the file format, `atomic` the atomic file writes. The public names are
re-exported here: import them from `moeviz.trace`.
"""

from moeviz.trace.atomic import pid_alive, remove_stale_partials, writing_atomically
from moeviz.trace.model import Trace
from moeviz.trace.parquet import READABLE_FORMATS, TRACE_FORMAT
from moeviz.trace.records import ROUTING_COLUMNS, TOKEN_COLUMNS, LayerRouting, LazyTokens, ModelInfo

__all__ = [
    "READABLE_FORMATS",
    "ROUTING_COLUMNS",
    "TOKEN_COLUMNS",
    "TRACE_FORMAT",
    "LayerRouting",
    "LazyTokens",
    "ModelInfo",
    "Trace",
    "pid_alive",
    "remove_stale_partials",
    "writing_atomically",
]
