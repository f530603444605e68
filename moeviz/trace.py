"""The Trace: the one data model that crosses every boundary downstream of capture.

Plain numpy and pandas, no torch: analysis, charts, the app and the CLI read a Trace or its frames and
never the model.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from moeviz.errors import TraceFormatError
from moeviz.scoring import scores_from_logits, selection_scores

TRACE_FORMAT = "moeviz.trace/2"
READABLE_FORMATS = ("moeviz.trace/1", TRACE_FORMAT)

TOKEN_COLUMNS = ["seq", "pos", "stream", "token_id", "token", "phase", "step", "predicted_id"]
ROUTING_COLUMNS = [
    "seq",
    "pos",
    "token_id",
    "token",
    "layer",
    "rank",
    "expert",
    "weight",
    "score",
    "selection_score",
    "logit",
    "site",
    "stream",
    "phase",
    "step",
]


_PARTIAL = re.compile(r"^\.(?P<name>.+?)(?:\.(?P<pid>\d+)(?:-[0-9a-f]+)?)?\.partial$")


def remove_stale_partials(path: str | Path) -> list[Path]:
    """Remove the hidden `.NAME.PID-TOKEN.partial` files next to `path` that a dead writer left (killed during
    `Trace.to_parquet`), and unnumbered ones of older versions; a live writer's are kept. Returns them."""
    path = Path(path)
    removed = []
    for tmp in path.parent.glob(f".{glob.escape(path.name)}*.partial"):
        match = _PARTIAL.match(tmp.name)
        if match is None or match["name"] != path.name:
            continue
        if match["pid"] is not None and pid_alive(int(match["pid"])):
            continue
        tmp.unlink(missing_ok=True)
        removed.append(tmp)
    return removed


def pid_alive(pid: int) -> bool:
    """Whether process `pid` of this host is running (the temp files of a writer carry its pid)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return pid > 0  # another user's process (or nonsense)
    return True


@dataclass
class ModelInfo:
    """What the capture knows about the model as a whole."""

    source: str
    model_type: str
    architecture: str
    num_layers: int
    num_parameters: int = 0
    dtype: str = "float32"  # the dtype the weights were loaded (or dequantised) at
    device: str = "cpu"  # where the weights are: "cuda:0"; with a device map "cuda:0 (30 modules), disk (16)"
    parameter_bytes: int = 0  # parameters and buffers at `dtype`
    notes: list[str] = field(default_factory=list)


@dataclass
class LayerRouting:
    """Routing of one MoE layer over all captured tokens it saw.

    N = tokens this layer routed (padding excluded), E = experts, k = slots per token.
    - token_rows [N]: row of each token in `Trace.tokens`
    - logits [N, E]: raw router logits (fp32)
    - scores [N, E] (derived, read-only): router scores, `score_fn(logits)`, before any top-k renormalisation
    - selection_scores [N, E] (derived, read-only): what the experts were selected on (scores + balancing
      bias, if any)
    - experts [N, k]: dispatched expert ids, -1 for a slot dropped by capacity; slots by descending weight
    - weights [N, k]: combination weights the model applied (0 for dropped)
    - bias [E] | None: balancing bias added for selection only
    - n_group, topk_group, group_score: group-limited routing (DeepSeek-V2/V3 style): experts are split into
      `n_group` contiguous groups, each token picks its best `topk_group` groups by `group_score` of the
      selection scores ("top2_sum": sum of the group's two best, V3/GLM/Kimi; "max": V2) and selects only
      among their experts. None when the router does not limit groups.
    """

    layer: int
    site: str
    token_rows: np.ndarray
    logits: np.ndarray
    experts: np.ndarray
    weights: np.ndarray
    score_fn: str
    bias: np.ndarray | None = None
    decision_source: str = "dispatch"  # "dispatch" | "router_output" | "recomputed" (not the model's own)
    top_k: int | None = None
    capacity: int | None = None
    shared_experts: int = 0
    module: str = ""
    n_group: int | None = None
    topk_group: int | None = None
    group_score: str | None = None  # "top2_sum" | "max" | None
    # derived arrays, computed on first use and kept while logits, score_fn and bias are the same objects
    _derived: dict[str, tuple[Any, np.ndarray]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        n = len(self.token_rows)
        for name, arr, dims in (
            ("logits", self.logits, 2),
            ("experts", self.experts, 2),
            ("weights", self.weights, 2),
        ):
            if arr.ndim != dims or arr.shape[0] != n:
                raise ValueError(f"layer {self.layer} {name}: expected [{n}, ...], got {list(arr.shape)}")
        if self.experts.shape != self.weights.shape:
            raise ValueError(
                f"layer {self.layer}: experts {self.experts.shape} != weights {self.weights.shape}"
            )

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_derived": {}}  # a pickle carries the logits, not what derives from them

    def _cached(self, name: str, key: tuple[Any, ...], compute) -> np.ndarray:
        hit = self._derived.get(name)
        if hit is not None and all(a is b for a, b in zip(hit[0], key, strict=True)):
            return hit[1]
        value = compute()
        self._derived[name] = (key, value)
        return value

    @property
    def scores(self) -> np.ndarray:
        """[N, E] router scores, `score_fn(logits)` in fp32 (`moeviz.scoring.scores_from_logits`): derived
        from `logits` on first use, never stored apart from them (read-only)."""
        key = (self.logits, self.score_fn)
        return self._cached("scores", key, lambda: scores_from_logits(self.logits, self.score_fn))

    @property
    def selection_scores(self) -> np.ndarray:
        """[N, E] what the experts were selected on: `scores` + `bias` (`scores` itself without a bias)."""
        key = (self.logits, self.score_fn, self.bias)
        return self._cached("selection_scores", key, lambda: selection_scores(self.scores, self.bias))

    @property
    def num_experts(self) -> int:
        return int(self.logits.shape[1])

    @property
    def k(self) -> int:
        return int(self.experts.shape[1])

    @property
    def key(self) -> tuple[str, int]:
        return (self.site, self.layer)


class LazyTokens:
    """A token table built on first use: `Trace(tokens=LazyTokens(build))` calls `build()` (→ the
    DataFrame, TOKEN_COLUMNS) the first time `trace.tokens` is read, so a capture whose caller never looks
    at the token strings does not decode them."""

    __slots__ = ("build",)

    def __init__(self, build: Callable[[], pd.DataFrame]) -> None:
        self.build = build


@dataclass
class Trace:
    """Tokens plus the routing of every MoE layer over them.

    `tokens` has one row per token: seq, pos (position within its sequence, padding excluded), stream
    ("input", or "decoder" for the decoder side of encoder-decoders), token_id, token (decoded text),
    phase ("prompt" | "generated"), step (generation step whose forward routed it; 0 = prompt) and
    predicted_id (the model's argmax next token at this position; -1 where it was not computed, i.e. the
    prompt positions before the last one in `generate`).

    `attention` (None unless captured with `attention=True`) is a `moeviz.attention.AttentionCapture`:
    exact rows/blocks/maps and per-head summaries computed on demand. It is not written to Parquet and
    not carried by `concat` (both give `attention=None`).
    """

    model: ModelInfo
    tokens: pd.DataFrame  # a property (below): a LazyTokens given here is built on first read
    layers: list[LayerRouting]
    attention: Any | None = None  # moeviz.attention.AttentionCapture (not imported: keeps Trace torch-free)

    def __getstate__(self) -> dict[str, Any]:
        self.tokens  # noqa: B018 - build a lazy token table: its builder is not picklable
        return dict(self.__dict__)

    def layer(self, layer: int, site: str | None = None) -> LayerRouting:
        for routing in self.layers:
            if routing.layer == layer and (site is None or routing.site == site):
                return routing
        raise KeyError(f"no MoE layer {layer}{'' if site is None else f' ({site})'} in this trace")

    @classmethod
    def concat(cls, traces: list[Trace]) -> Trace:
        """One trace from several captures of the same model (e.g. the batches of a corpus): sequences are
        renumbered in order, each layer's rows appended."""
        if not traces:
            raise ValueError("nothing to concatenate")
        token_parts, layers, offset_rows, offset_seq = [], {}, 0, 0
        for trace in traces:
            tokens = trace.tokens.copy()
            tokens["seq"] += offset_seq
            token_parts.append(tokens)
            for routing in trace.layers:
                layers.setdefault(routing.key, []).append((routing, offset_rows))
            offset_rows += len(tokens)
            offset_seq += int(trace.tokens["seq"].max()) + 1 if len(trace.tokens) else 0
        merged = []
        for parts in layers.values():
            first = parts[0][0]
            stack = lambda name, parts=parts: np.concatenate([getattr(r, name) for r, _ in parts])  # noqa: E731
            merged.append(
                dataclasses.replace(
                    first,
                    token_rows=np.concatenate([r.token_rows + off for r, off in parts]),
                    **{n: stack(n) for n in ("logits", "experts", "weights")},
                )
            )
        return cls(model=traces[0].model, tokens=pd.concat(token_parts, ignore_index=True), layers=merged)

    @property
    def layer_keys(self) -> list[tuple[str, int]]:
        return [routing.key for routing in self.layers]

    def routing_frame(self) -> pd.DataFrame:
        """Tidy routing table: one row per (seq, pos, layer, rank); see ROUTING_COLUMNS and the README."""
        parts = [_layer_frame(self.tokens, routing) for routing in self.layers]
        if not parts:
            return pd.DataFrame({c: [] for c in ROUTING_COLUMNS})
        return pd.concat(parts, ignore_index=True)[ROUTING_COLUMNS]

    def scores_frame(self, layer: int, site: str | None = None) -> pd.DataFrame:
        """Token × expert frame of one layer: seq, pos, token, expert, score, logit, selection_score,
        dispatched (bool), weight (0 where not dispatched). [N·E rows]"""
        routing = self.layer(layer, site)
        n, e = routing.logits.shape
        tokens = self.tokens.iloc[routing.token_rows].reset_index(drop=True)
        dispatched = np.zeros((n, e), dtype=bool)
        weight = np.zeros((n, e), dtype=np.float32)
        rows, slots = np.nonzero(routing.experts >= 0)
        dispatched[rows, routing.experts[rows, slots]] = True
        weight[rows, routing.experts[rows, slots]] = routing.weights[rows, slots]
        frame = pd.DataFrame(
            {
                "row": np.repeat(np.arange(n), e),
                "expert": np.tile(np.arange(e), n),
                "score": routing.scores.reshape(-1),
                "logit": routing.logits.reshape(-1),
                "selection_score": routing.selection_scores.reshape(-1),
                "dispatched": dispatched.reshape(-1),
                "weight": weight.reshape(-1),
            }
        )
        for column in ("seq", "pos", "token_id", "token"):
            frame[column] = tokens[column].to_numpy()[frame["row"].to_numpy()]
        return frame

    # ---- Parquet -----------------------------------------------------------------------------------
    def to_parquet(self, path: str | Path) -> Path:
        """Write the routing table (plus each token's full logits) to one Parquet file, atomically.

        Format `moeviz.trace/2`: one row per (token, layer, rank) with ROUTING_COLUMNS, and a `logits`
        column (list<float32>, the token's E router logits) on each token's rank-0 row only, null on the
        others (as the store keeps per-token values); version 1 repeated them on all k rows. The file's
        `moeviz` metadata holds the format, the model info, the token table and each layer's facts.
        """
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = Path(path)
        frame = self.routing_frame()
        table = pa.Table.from_pandas(frame, preserve_index=False)
        table = table.append_column("logits", _rank0_logits_column(self.layers))
        meta = {
            "format": TRACE_FORMAT,
            "model": asdict(self.model),
            "tokens": {c: self.tokens[c].tolist() for c in TOKEN_COLUMNS},
            "layers": [_layer_meta(r) for r in self.layers],
        }
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), b"moeviz": json.dumps(meta)})
        remove_stale_partials(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.partial")
        try:
            with open(tmp, "wb") as handle:
                pq.write_table(
                    table,
                    handle,
                    compression="zstd",
                    # distinct floats: no dictionary; bytes split by significance compress well
                    use_dictionary=[c for c in table.column_names if c != "logits"],
                    column_encoding={"logits.list.element": "BYTE_STREAM_SPLIT"},
                )
                handle.flush()
                os.fsync(handle.fileno())  # the bytes are on disk before the name says the file is complete
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)
        return path

    @classmethod
    def from_parquet(cls, path: str | Path) -> Trace:
        """Read a trace written by `to_parquet` (format version 2, or version 1)."""
        import pyarrow.parquet as pq

        path = Path(path)
        try:
            table = pq.read_table(path)
        except Exception as exc:  # pyarrow raises several types for non-Parquet input
            raise TraceFormatError(f"{path}: not a readable Parquet file ({exc})") from exc
        raw = (table.schema.metadata or {}).get(b"moeviz")
        if raw is None:
            raise TraceFormatError(f"{path}: a Parquet file, but not a moeviz trace (no 'moeviz' metadata)")
        meta = json.loads(raw)
        if meta.get("format") not in READABLE_FORMATS:
            raise TraceFormatError(
                f"{path}: trace format {meta.get('format')!r}, expected one of {list(READABLE_FORMATS)}"
            )
        per_rank = meta["format"] == "moeviz.trace/1"  # version 1: the logits repeated on every rank's row
        tokens = pd.DataFrame(meta["tokens"])[TOKEN_COLUMNS]
        frame = table.drop_columns(["logits"]).to_pandas()
        logits_all = table.column("logits").combine_chunks()
        token_index = pd.MultiIndex.from_frame(tokens[["stream", "seq", "pos"]])
        layers, start = [], 0
        for info in meta["layers"]:
            n_rows = info["num_tokens"] * info["k"]
            if start + n_rows > len(frame):
                raise TraceFormatError(f"{path}: {len(frame)} routing rows, metadata accounts for more")
            part = frame.iloc[start : start + n_rows : info["k"]]
            token_rows = token_index.get_indexer(pd.MultiIndex.from_frame(part[["stream", "seq", "pos"]]))
            if (token_rows < 0).any():
                raise TraceFormatError(f"{path}: routing rows refer to tokens missing from the token table")
            rows = frame.iloc[start : start + n_rows]
            logits = _layer_logits(path, info, logits_all.slice(start, n_rows), per_rank)
            layers.append(_layer_from_rows(info, token_rows, rows, logits))
            start += n_rows
        if start != len(frame):
            raise TraceFormatError(f"{path}: {len(frame)} routing rows, metadata accounts for {start}")
        return cls(model=ModelInfo(**meta["model"]), tokens=tokens, layers=layers)


def _get_tokens(trace: Trace) -> pd.DataFrame:
    value = trace.__dict__["_tokens"]
    if isinstance(value, LazyTokens):
        value = value.build()
        trace.__dict__["_tokens"] = value
    return value


def _set_tokens(trace: Trace, value: pd.DataFrame | LazyTokens) -> None:
    trace.__dict__["_tokens"] = value


Trace.tokens = property(_get_tokens, _set_tokens, doc="The token table (see the class docstring).")  # type: ignore[assignment]


def _layer_frame(tokens: pd.DataFrame, routing: LayerRouting) -> pd.DataFrame:
    n, k = routing.experts.shape
    rows = np.repeat(routing.token_rows, k)
    token_index = np.repeat(np.arange(n), k)
    experts = routing.experts.reshape(-1)
    valid = experts >= 0
    safe = np.where(valid, experts, 0)

    def per_expert(values: np.ndarray) -> np.ndarray:
        picked = values[token_index, safe].astype(np.float32)
        return np.where(valid, picked, np.float32(np.nan))

    frame = pd.DataFrame(
        {
            "layer": np.full(n * k, routing.layer, dtype=np.int64),
            "rank": np.tile(np.arange(k, dtype=np.int64), n),
            "expert": experts.astype(np.int64),
            "weight": routing.weights.reshape(-1).astype(np.float32),
            "score": per_expert(routing.scores),
            "selection_score": per_expert(routing.selection_scores),
            "logit": per_expert(routing.logits),
            "site": routing.site,
        }
    )
    for column in TOKEN_COLUMNS:
        frame[column] = tokens[column].to_numpy()[rows]
    return frame


def _rank0_logits_column(layers: list[LayerRouting]):
    """One Arrow list<float32> column over all routing rows (layer by layer, k rows per token): each token's
    [E] logits on its rank-0 row, null on the other k-1 (E may differ between layers)."""
    import pyarrow as pa

    lengths, valid, values = [], [], []
    for routing in layers:
        n, k = routing.experts.shape
        rank0 = np.zeros(n * k, dtype=bool)
        rank0[::k] = True
        lengths.append(np.where(rank0, routing.num_experts, 0).astype(np.int64))
        valid.append(rank0)
        values.append(np.ascontiguousarray(routing.logits, dtype=np.float32).reshape(-1))
    lengths_all = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    offsets = np.zeros(len(lengths_all) + 1, dtype=np.int64)
    np.cumsum(lengths_all, out=offsets[1:])
    if offsets[-1] >= 2**31:
        raise ValueError("trace too large for one Parquet file: more than 2^31 logits")
    null = ~np.concatenate(valid) if valid else np.zeros(0, bool)
    return pa.ListArray.from_arrays(
        pa.array(offsets.astype(np.int32), type=pa.int32()),
        pa.array(np.concatenate(values) if values else np.zeros(0, np.float32), type=pa.float32()),
        mask=pa.array(null, type=pa.bool_()),
    )


def _layer_logits(path: Path, info: dict[str, Any], column, per_rank: bool) -> np.ndarray:
    """[N, E] float32 logits of one layer from its [N·k] rows of the `logits` column (rank-0 rows only in
    version 2; every row, k equal copies, in version 1)."""
    n, k, e = info["num_tokens"], info["k"], info["num_experts"]
    flat = np.asarray(column.flatten().to_numpy(zero_copy_only=False), dtype=np.float32)
    expected = n * k * e if per_rank else n * e
    if flat.size != expected:
        raise TraceFormatError(f"{path}: layer {info['layer']}: {flat.size} logits, expected {expected}")
    return flat.reshape(n, k, e)[:, 0] if per_rank else flat.reshape(n, e)


def _layer_meta(routing: LayerRouting) -> dict[str, Any]:
    return {
        "layer": routing.layer,
        "site": routing.site,
        "num_tokens": len(routing.token_rows),
        "k": routing.k,
        "num_experts": routing.num_experts,
        "score_fn": routing.score_fn,
        "bias": None if routing.bias is None else routing.bias.astype(float).tolist(),
        "decision_source": routing.decision_source,
        "top_k": routing.top_k,
        "capacity": routing.capacity,
        "shared_experts": routing.shared_experts,
        "module": routing.module,
        "n_group": routing.n_group,
        "topk_group": routing.topk_group,
        "group_score": routing.group_score,
    }


def _layer_from_rows(
    info: dict[str, Any], token_rows: np.ndarray, part: pd.DataFrame, logits: np.ndarray
) -> LayerRouting:
    n, k = info["num_tokens"], info["k"]
    bias = None if info["bias"] is None else np.asarray(info["bias"], dtype=np.float32)
    return LayerRouting(
        layer=info["layer"],
        site=info["site"],
        token_rows=token_rows,
        logits=logits,
        experts=part["expert"].to_numpy().reshape(n, k),
        weights=part["weight"].to_numpy().astype(np.float32).reshape(n, k),
        score_fn=info["score_fn"],
        bias=bias,
        decision_source=info["decision_source"],
        top_k=info["top_k"],
        capacity=info["capacity"],
        shared_experts=info["shared_experts"],
        module=info["module"],
        n_group=info.get("n_group"),  # absent from traces written before group facts were recorded
        topk_group=info.get("topk_group"),
        group_score=info.get("group_score"),
    )
