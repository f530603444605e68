"""The Trace's sibling for routing without tokens: expert load an engine counted without recording which token
went where (SGLang's `stat` and `per_pass` expert-distribution dumps, MoE-Infinity's count matrices; read by
`moeviz.engines`).

`ExpertLoad` is the per-layer load table of such a source: counts [S, L, E] over S recorded steps (forward
passes, sequences or one sum). Its tidy frame (`frame()`: step, layer, site, expert, count) is what the
balance indicators, the collapse verdicts and the expert-parallel what-if read; there is no token axis, so
nothing that needs one (scores, margins, sequences, per-token views) applies. It round-trips to Parquet
(format `moeviz.load/1`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from moeviz.errors import TraceFormatError
from moeviz.trace.atomic import writing_atomically
from moeviz.trace.records import ModelInfo

LOAD_FORMAT = "moeviz.load/1"
LOAD_COLUMNS = ["step", "layer", "site", "expert", "count"]


@dataclass
class ExpertLoad:
    """Expert counts of one model's MoE layers, without tokens.

    - counts [S, L, E] int64: dispatched slots per (step, MoE layer, expert); a token sent to k experts
      counts once for each (Σ_e counts = k · tokens for a layer that dropped nothing)
    - layers [L]: block index of each MoE layer
    - top_k: experts per token (k), to turn slots into tokens
    - steps [S]: a label per step (SGLang's forward_pass_id, a file name); 0 … S−1 when the source has none
    - source: the import format ("sglang-dump", "moe-infinity")
    """

    model: ModelInfo
    counts: np.ndarray
    layers: list[int]
    top_k: int
    source: str
    steps: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.counts.ndim != 3 or self.counts.shape[1] != len(self.layers):
            raise ValueError(f"counts {list(self.counts.shape)} do not match {len(self.layers)} layers")
        if not self.steps:
            self.steps = [str(i) for i in range(self.counts.shape[0])]
        if len(self.steps) != self.counts.shape[0]:
            raise ValueError(f"{len(self.steps)} step labels for {self.counts.shape[0]} steps")

    @property
    def num_experts(self) -> int:
        return int(self.counts.shape[2])

    def layer_counts(self) -> np.ndarray:
        """[L, E] counts summed over steps."""
        return self.counts.sum(axis=0)

    def frame(self) -> pd.DataFrame:
        """Tidy load table, one row per (step, layer, expert): LOAD_COLUMNS (site is "mlp")."""
        s, n_layers, e = self.counts.shape
        return pd.DataFrame(
            {
                "step": np.repeat(np.asarray(self.steps, dtype=object), n_layers * e),
                "layer": np.tile(np.repeat(np.asarray(self.layers, np.int64), e), s),
                "site": "mlp",
                "expert": np.tile(np.arange(e, dtype=np.int64), s * n_layers),
                "count": self.counts.reshape(-1).astype(np.int64),
            }
        )[LOAD_COLUMNS]

    def to_parquet(self, path: str | Path) -> Path:
        """Write the load table to one Parquet file, atomically (format `moeviz.load/1`)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.Table.from_pandas(self.frame(), preserve_index=False)
        meta = {
            "format": LOAD_FORMAT,
            "model": asdict(self.model),
            "layers": list(self.layers),
            "top_k": self.top_k,
            "source": self.source,
            "steps": list(self.steps),
            "num_experts": self.num_experts,
        }
        table = table.replace_schema_metadata({b"moeviz": json.dumps(meta)})
        path = Path(path)
        with writing_atomically(path) as handle:
            pq.write_table(table, handle, compression="zstd")
        return path

    @classmethod
    def from_parquet(cls, path: str | Path) -> ExpertLoad:
        """Read a load table written by `to_parquet`; TraceFormatError for anything else."""
        import pyarrow.parquet as pq

        path = Path(path)
        meta = read_moeviz_meta(path)
        if meta.get("format") != LOAD_FORMAT:
            raise TraceFormatError(f"{path}: format {meta.get('format')!r}, expected {LOAD_FORMAT!r}")
        counts = pq.read_table(path, columns=["count"]).column("count").to_numpy()
        shape = (len(meta["steps"]), len(meta["layers"]), int(meta["num_experts"]))
        if counts.size != int(np.prod(shape)):
            raise TraceFormatError(f"{path}: {counts.size} counts, the metadata describes {shape}")
        return cls(
            model=ModelInfo(**meta["model"]),
            counts=counts.reshape(shape).astype(np.int64),
            layers=[int(x) for x in meta["layers"]],
            top_k=int(meta["top_k"]),
            source=str(meta["source"]),
            steps=[str(x) for x in meta["steps"]],
        )


def read_moeviz_meta(path: Path) -> dict:
    """The `moeviz` metadata of a Parquet file written by moeviz (a trace or a load table)."""
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except Exception as exc:  # pyarrow raises several types for non-Parquet input
        raise TraceFormatError(f"{path}: not a readable Parquet file ({exc})") from exc
    raw = (schema.metadata or {}).get(b"moeviz")
    if raw is None:
        raise TraceFormatError(f"{path}: a Parquet file, but not written by moeviz (no 'moeviz' metadata)")
    return json.loads(raw)


def read_routing_file(path: str | Path):
    """A moeviz routing file: a Trace (`moeviz capture`, `moeviz import` of per-token routing) or an
    ExpertLoad (`moeviz import` of counts), by the format its metadata names."""
    from moeviz.trace.model import Trace

    path = Path(path)
    if read_moeviz_meta(path).get("format") == LOAD_FORMAT:
        return ExpertLoad.from_parquet(path)
    return Trace.from_parquet(path)
