"""The Trace's sibling for routing without tokens: expert load an engine counted without recording which token
went where (SGLang's `stat` and `per_pass` expert-distribution dumps, MoE-Infinity's count matrices; read by
`moeviz.engines`).

`ExpertLoad` is the per-layer load table of such a source: counts [S, L, E] over S recorded steps (forward
passes, sequences or one sum). Its tidy frame (`frame()`: step, layer, site, expert, count) is what the
balance indicators, the collapse verdicts and the expert-parallel what-if read; there is no token axis, so
nothing that needs one (scores, margins, sequences, per-token views) applies. It round-trips to Parquet
(format `moeviz.load/2`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from moeviz.errors import TraceFormatError
from moeviz.trace import validate
from moeviz.trace.atomic import writing_atomically
from moeviz.trace.parquet import TRACE_FORMAT
from moeviz.trace.records import ModelInfo

LOAD_FORMAT = "moeviz.load/2"  # 2: version 1 with the metadata's SHA-256 and page checksums
LOAD_FORMATS = ("moeviz.load/1", LOAD_FORMAT)
_HASHED = (LOAD_FORMAT, TRACE_FORMAT)  # formats whose metadata must carry its SHA-256
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
        """Write the load table to one Parquet file, atomically (format `moeviz.load/2`)."""
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
        raw = json.dumps(meta).encode()
        table = table.replace_schema_metadata(
            {validate.META_KEY: raw, validate.HASH_KEY: validate.metadata_hash(raw)}
        )
        path = Path(path)
        with writing_atomically(path) as handle:
            pq.write_table(table, handle, compression="zstd", write_page_checksum=True)
        return path

    @classmethod
    def from_parquet(cls, path: str | Path) -> ExpertLoad:
        """Read a load table written by `to_parquet`, validated before it is trusted
        (`moeviz.trace.validate`); TraceFormatError for anything else."""
        import pyarrow as pa

        path = Path(path)
        footer = validate.open_footer(path)
        meta = read_moeviz_meta(path, footer)
        if meta.get("format") not in LOAD_FORMATS:
            raise TraceFormatError(
                f"{path}: format {meta.get('format')!r}, expected one of {list(LOAD_FORMATS)}"
            )
        keys = {"format", "model", "layers", "top_k", "source", "steps", "num_experts"}
        validate.require(
            path, "metadata", set(meta) == keys, f"expected the keys {sorted(keys)}, got {sorted(meta)}"
        )
        model = validate.model_info(path, meta["model"])
        layers, steps = meta["layers"], meta["steps"]
        validate.require(
            path, "layers", isinstance(layers, list) and len(layers) > 0, "expected a list of blocks"
        )
        for index, layer in enumerate(layers):
            validate.checked_int(path, f"layers[{index}]", layer)
        validate.require(
            path, "steps", isinstance(steps, list) and len(steps) > 0, "expected a list of labels"
        )
        validate.require(path, "steps", all(isinstance(s, str) for s in steps), "expected strings")
        experts = validate.checked_int(path, "num_experts", meta["num_experts"], 1, validate.MAX_EXPERTS)
        top_k = validate.checked_int(path, "top_k", meta["top_k"], 1, experts)
        validate.require(path, "source", isinstance(meta["source"], str), "expected a string")
        shape = (len(steps), len(layers), experts)
        rows = int(np.prod(shape))
        validate.check_footer(path, footer, rows=rows, columns={"count": "integer"}, needs=rows * 16)
        try:
            table = footer.read(columns=["count"])
        except (OSError, pa.ArrowException) as exc:  # a page whose CRC does not match, a damaged page
            raise TraceFormatError(f"{path}: a damaged data page ({exc})") from exc
        validate.no_nulls(path, table, ["count"])
        counts = table.column("count").to_numpy().astype(np.int64)
        validate.require(path, "count", counts.size == 0 or counts.min() >= 0, "a negative count")
        return cls(
            model=model,
            counts=counts.reshape(shape),
            layers=list(layers),
            top_k=top_k,
            source=meta["source"],
            steps=list(steps),
        )


def read_moeviz_meta(path: Path, footer=None) -> dict:
    """The `moeviz` metadata of a Parquet file written by moeviz (a trace or a load table), as a dict, its
    integrity hash verified (`moeviz.trace.validate.read_metadata`)."""
    footer = validate.open_footer(path) if footer is None else footer
    return validate.read_metadata(path, footer, hashed=lambda fmt: fmt in _HASHED)


def read_routing_file(path: str | Path):
    """A moeviz routing file: a Trace (`moeviz capture`, `moeviz import` of per-token routing) or an
    ExpertLoad (`moeviz import` of counts), by the format its metadata names."""
    from moeviz.trace.model import Trace

    path = Path(path)
    if read_moeviz_meta(path).get("format") in LOAD_FORMATS:
        return ExpertLoad.from_parquet(path)
    return Trace.from_parquet(path)
