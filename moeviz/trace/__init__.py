"""The Trace data model: tokens plus the routing of every MoE layer over them (no torch).

`records` holds its parts (`ModelInfo`, `LayerRouting`, `LazyTokens`, the table columns), `model` the
`Trace` and its frames, `parquet` the file format, `atomic` the atomic file writes, `load` the Trace's
sibling for routing without tokens (`ExpertLoad`: an engine's expert counts) and `read_routing_file`, which
opens either file. The public names are
re-exported here: import them from `moeviz.trace`.
"""

from moeviz.trace.atomic import pid_alive, remove_stale_partials, writing_atomically
from moeviz.trace.load import LOAD_FORMAT, LOAD_FORMATS, ExpertLoad, read_routing_file
from moeviz.trace.model import Trace
from moeviz.trace.parquet import READABLE_FORMATS, TRACE_FORMAT
from moeviz.trace.records import (
    ROUTING_COLUMNS,
    TOKEN_COLUMNS,
    UNKNOWN_TOKEN,
    LayerRouting,
    LazyTokens,
    ModelInfo,
)

__all__ = [
    "LOAD_FORMAT",
    "LOAD_FORMATS",
    "READABLE_FORMATS",
    "ROUTING_COLUMNS",
    "TOKEN_COLUMNS",
    "TRACE_FORMAT",
    "UNKNOWN_TOKEN",
    "ExpertLoad",
    "LayerRouting",
    "LazyTokens",
    "ModelInfo",
    "Trace",
    "pid_alive",
    "read_routing_file",
    "remove_stale_partials",
    "writing_atomically",
]
