"""The Trace: the one data model that crosses every boundary downstream of capture — tokens plus the
routing of every MoE layer over them, and the tidy frames read from it.

Plain numpy and pandas, no torch: analysis, charts, the app and the CLI read a Trace or its frames and
never the model. Its parts are in `moeviz.trace.records`, its file format in `moeviz.trace.parquet`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from moeviz.trace.records import (
    CAPTURE_SOURCES,
    ROUTING_COLUMNS,
    TOKEN_COLUMNS,
    LayerRouting,
    LazyTokens,
    ModelInfo,
    absent,
)

PREVIEW_TOKENS = 24  # tokens of the first sequence shown under a trace's notebook view
# decision_source of moeviz's own captures; any other names the engine format the routing was imported from
OWN_SOURCES = CAPTURE_SOURCES
LEFT = "style='text-align:left'"  # notebooks centre or right-align table cells by default


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
        token_parts, offset_rows, offset_seq = [], 0, 0
        layers: dict[tuple[str, int], list[tuple[LayerRouting, int]]] = {}  # key -> (routing, row offset)
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
            merged.append(
                dataclasses.replace(
                    first,
                    token_rows=np.concatenate([r.token_rows + off for r, off in parts]),
                    **_stacked([r for r, _ in parts]),
                )
            )
        return cls(model=traces[0].model, tokens=pd.concat(token_parts, ignore_index=True), layers=merged)

    @property
    def layer_keys(self) -> list[tuple[str, int]]:
        return [routing.key for routing in self.layers]

    def _summary(self) -> dict[str, str]:
        """The trace in a few labelled facts (what a notebook shows for it): model, tokens, sequences, MoE
        layers, experts, k, score function, where the routing came from, logits, weights, attention."""
        tokens, layers = self.tokens, self.layers

        def values(read) -> str:  # one value, or the distinct values of the layers
            found = list(dict.fromkeys(read(r) for r in layers))
            return ", ".join(str(v) for v in found) if found else "–"

        def share(flag: str) -> str:  # a flag every layer has, none has, or some have
            count = sum(bool(getattr(r, flag)) for r in layers)
            if count and count == len(layers):
                return "yes"
            return f"{count} of {len(layers)} layers" if count else "no"

        sources = sorted({r.decision_source for r in layers})
        own = OWN_SOURCES
        engines = [s for s in sources if s not in own]
        origin = ", ".join(
            [f"capture ({s})" for s in sources if s in own] + [f"engine import ({s})" for s in engines]
        )
        model = self.model
        blocks = sorted({r.layer for r in layers})
        return {
            "model": model.source,
            "architecture": f"{model.architecture} ({model.model_type}), {model.dtype} on {model.device}",
            "tokens": f"{len(tokens):,}",
            "sequences": f"{tokens['seq'].nunique() if len(tokens) else 0:,}",
            "MoE layers": f"{len(layers)}"
            + (f" (blocks {blocks[0]}–{blocks[-1]})" if len(blocks) > 1 else ""),
            "experts": values(lambda r: r.num_experts),
            "k": values(lambda r: r.k),
            "score function": values(lambda r: r.score_fn),
            "routing from": origin or "–",
            "router logits": share("has_logits"),
            "combination weights": share("has_weights"),
            "attention": "captured" if self.attention is not None else "not captured",
        }

    def _repr_html_(self) -> str:
        """The notebook view: `_summary()` as a table, then the first tokens of the first sequence."""
        rows = "".join(
            f"<tr><th {LEFT}>{escape(key)}</th><td {LEFT}>{escape(value)}</td></tr>"
            for key, value in self._summary().items()
        )
        tokens = self.tokens
        first = tokens[tokens["seq"] == tokens["seq"].iloc[0]]["token"] if len(tokens) else pd.Series([])
        preview = "".join(f"<code>{escape(str(t))}</code> " for t in first.head(PREVIEW_TOKENS))
        more = " …" if len(first) > PREVIEW_TOKENS else ""
        return (
            f"<div><strong>moeviz.Trace</strong><table>{rows}</table>"
            f"<p>first tokens: {preview or '–'}{more}</p></div>"
        )

    def routing_frame(self) -> pd.DataFrame:
        """Tidy routing table: one row per (seq, pos, layer, rank); see ROUTING_COLUMNS and the table schema
        in docs/library.md."""
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
        """Write the routing table (plus each token's full logits) to one Parquet file, atomically, in
        format `moeviz.trace/4` (described in `moeviz.trace.parquet`)."""
        from moeviz.trace.parquet import write_trace

        return write_trace(Path(path), self.model, self.tokens, self.layers, self.routing_frame())

    @classmethod
    def from_parquet(cls, path: str | Path) -> Trace:
        """Read a trace written by `to_parquet` (format version 2, or version 1)."""
        from moeviz.trace.parquet import read_trace

        model, tokens, layers = read_trace(Path(path))
        return cls(model=model, tokens=tokens, layers=layers)


def _stacked(parts: list[LayerRouting]) -> dict[str, Any]:
    """logits, experts and weights of one layer's parts, appended; an all-NaN part stays a view (`absent`)
    when every part is one, so imported routing without logits never allocates [N, E]."""
    n = sum(len(r.token_rows) for r in parts)
    out: dict[str, Any] = {"experts": np.concatenate([r.experts for r in parts])}
    for name, flag in (("logits", "has_logits"), ("weights", "has_weights")):
        out[flag] = any(getattr(r, flag) for r in parts)
        if out[flag]:
            out[name] = np.concatenate([getattr(r, name) for r in parts])
        else:
            out[name] = absent(n, getattr(parts[0], name).shape[1])
    return out


def _get_tokens(trace: Trace) -> pd.DataFrame:
    value = trace.__dict__["_tokens"]
    if isinstance(value, LazyTokens):
        value = value.build()
        trace.__dict__["_tokens"] = value
    return value


def _set_tokens(trace: Trace, value: pd.DataFrame | LazyTokens) -> None:
    trace.__dict__["_tokens"] = value


Trace.tokens = property(_get_tokens, _set_tokens, doc="The token table (see the class docstring).")


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
