"""Attention views: the layer × head summary grid, one head's map over a visible window, one token's row and
the KV-cache what-if. Frames in, `alt.Chart` out; the frames come from `Trace.attention` (no T × T map is
ever needed: maps arrive as blocks the caller asked for)."""

from __future__ import annotations

import json
import math
from typing import Any, Literal

import altair as alt
import numpy as np
import pandas as pd

from moeviz.charts._common import FIT_WIDTH, layered_chart
from moeviz.charts.raster import ColourRamp, raster_heatmap
from moeviz.charts.routing import token_label

HEAD_SELECTION = "head"  # name of the head grid's click selection (fields layer, head)
NO_MAP = "no map"
# Head-summary metrics: column of `AttentionCapture.head_summary()` -> (title, colour scheme, one-line help).
HeadScheme = Literal["viridis", "oranges", "reds", "greens"]
HEAD_METRICS: dict[str, tuple[str, HeadScheme, str]] = {
    "mean_entropy": (
        "Entropy (nats)",
        "viridis",
        "H = −Σ_j p_j log p_j of each query's attention row, averaged over tokens: 0 = all mass on one key, "
        "log(i+1) = spread evenly over the i+1 keys it can see.",
    ),
    "mean_mean_distance": (
        "Mean distance (tokens)",
        "oranges",
        "d = Σ_j p_j (i − j): how far back, in tokens, a query looks on average (0 = at itself).",
    ),
    "mean_sink_mass": (
        "Sink mass",
        "reds",
        "p_0: the share of attention on the first token. Heads that park most of their mass there are "
        '"attention sinks" (kind sink when > 0.5).',
    ),
    "mean_local_mass": (
        "Local mass",
        "greens",
        "Σ_{0 ≤ i−j < W} p_j: the share on the last W keys (the window chosen above). Kind local when > 0.5; "
        "neither sink nor local = global.",
    ),
}


# Colour domains of the head grids. Masses are shares of a probability row: always [0, 1], so 0.99999999 and
# 1.00000003 are the same colour. Entropy (nats) and mean distance (tokens) start at 0 and end at their
# largest possible value for the longest sequence T (log T and T − 1), or, without T, at the largest value
# shown but never below one bit (log 2 nats) or one token: floating-point noise never spans the scale.
_MASS_METRICS = ("mean_sink_mass", "mean_local_mass")
_MIN_TOP = {"mean_entropy": math.log(2), "mean_mean_distance": 1.0}


def head_metric_domain(metric: str, values: pd.Series, num_tokens: int | None = None) -> list[float]:
    """The colour domain [lo, hi] of a head-grid metric (see `head_metric_heatmap`)."""
    if metric in _MASS_METRICS:
        return [0.0, 1.0]
    finite = values[np.isfinite(values)] if len(values) else values
    top = max(float(finite.max()) if len(finite) else 0.0, _MIN_TOP[metric])
    if num_tokens is not None and num_tokens > 1:
        top = max(top, math.log(num_tokens) if metric == "mean_entropy" else float(num_tokens - 1))
    return [0.0, top]


def head_grid_frame(head_summary: pd.DataFrame) -> pd.DataFrame:
    """`AttentionCapture.head_summary()` with every layer that has no map spread over all head columns
    (value NaN, kind "no map", its reason), so the grid shows such layers as one labelled row."""
    heads = head_summary[head_summary["head"] >= 0]
    num_heads = int(heads["head"].max()) + 1 if len(heads) else 1
    missing = head_summary[head_summary["head"] < 0]
    spread = [
        pd.DataFrame({"layer": int(layer), "head": range(num_heads), "kind": NO_MAP, "reason": reason})
        for layer, reason in zip(missing["layer"], missing["reason"], strict=True)
    ]
    out = pd.concat([heads, *spread], ignore_index=True) if spread else heads.reset_index(drop=True)
    out["reason"] = out["reason"].fillna("")
    return out.sort_values(["layer", "head"], ignore_index=True)


def head_metric_heatmap(
    head_summary: pd.DataFrame,
    metric: str,
    *,
    selectable: bool = True,
    title: str | None = None,
    num_tokens: int | None = None,
) -> alt.LayerChart:
    """Layer × head heatmap of one head-summary metric (a column named in `HEAD_METRICS`).

    Input: `AttentionCapture.head_summary(window)` (layer, head, mean_* columns, kind, reason; layers without
    a map have head −1). Heads run along x, layers down y; colour = the metric, the head's kind is written in
    the cell (S = sink, L = local, G = global); layers without a map are grey with their reason on hover.
    With `selectable`, clicking a cell selects the head (point selection `head` over layer and head).

    Colour domain (`head_metric_domain`), fixed by the statistic so that floating-point noise is never
    painted as a full colour range and grids of different layers and models compare: sink and local mass
    [0, 1] (shares of a probability row); entropy [0, log T] nats and mean distance [0, T − 1] tokens with
    `num_tokens` = T, the longest sequence (the largest values a head can reach). Without `num_tokens` the
    scale runs from 0 to the largest value shown, but at least log 2 nats (one bit) or one token.
    """
    if metric not in HEAD_METRICS:
        raise ValueError(f"unknown metric {metric!r}; one of {sorted(HEAD_METRICS)}")
    label, scheme, _ = HEAD_METRICS[metric]
    grid = head_grid_frame(head_summary)
    data = pd.DataFrame(
        {
            "layer": grid["layer"].astype(int),
            "head": grid["head"].astype(int),
            "value": grid[metric].astype(float) if metric in grid else np.nan,
            "kind": grid["kind"].astype(str),
            "reason": grid["reason"].astype(str),
        }
    )
    data["mark"] = data["kind"].map({"sink": "S", "local": "L", "global": "G"}).fillna("—")
    num_layers = int(data["layer"].nunique()) if len(data) else 1
    tooltip = [
        alt.Tooltip("layer:O"),
        alt.Tooltip("head:O"),
        alt.Tooltip("value:Q", format=".3f", title=label),
        alt.Tooltip("kind:N"),
        alt.Tooltip("reason:N"),
    ]
    base = alt.Chart().encode(
        x=alt.X("head:O", axis=alt.Axis(title="head", labelAngle=0)),
        y=alt.Y("layer:O", axis=alt.Axis(title="layer")),
        tooltip=tooltip,
    )
    cells = base.mark_rect(stroke="white").encode(
        color=alt.condition(
            f"datum.kind == '{NO_MAP}'",
            alt.value("#d9d9d9"),
            alt.Color(
                "value:Q",
                scale=alt.Scale(
                    scheme=scheme, domain=head_metric_domain(metric, data["value"], num_tokens), clamp=True
                ),
                legend=alt.Legend(title=None),
            ),
        )
    )
    if selectable:
        cells = cells.add_params(
            alt.selection_point(name=HEAD_SELECTION, fields=["layer", "head"], on="click", clear="dblclick")
        )
    text = base.mark_text(fontSize=10, color="black", opacity=0.7).encode(text=alt.Text("mark:N"))
    return layered_chart(
        cells,
        text,
        data=data,
        title=alt.Title(title or label, subtitle="S sink · L local · G global · grey: no map"),
        height=min(max(24 * num_layers, 96), 640),
        autosize=FIT_WIDTH,
    )


def _position_labels(tokens: pd.DataFrame, positions: np.ndarray) -> dict[int, str]:
    """{pos: `token_label`} for the given positions of one sequence's tokens (columns pos, token); "?" for a
    position the tokens do not have."""
    text = dict(zip(tokens["pos"].astype(int), tokens["token"].astype(str), strict=True))
    return {int(p): token_label(int(p), text.get(int(p), "?")) for p in positions}


def attention_block_frame(
    block: np.ndarray, rows: np.ndarray, cols: np.ndarray, tokens: pd.DataFrame
) -> pd.DataFrame:
    """Tidy cells of an attention block: one row per (query, key) with query_pos, key_pos, their labels
    ("pos:token") and weight.

    Input: `AttentionCapture.block(...)` [R, C], the R query and C key positions it covers, and the tokens of
    that sequence (`Trace.tokens` rows of one seq, columns pos, token).
    """
    rows, cols = np.asarray(rows, dtype=np.int64), np.asarray(cols, dtype=np.int64)
    if block.shape != (len(rows), len(cols)):
        raise ValueError(f"block {block.shape} does not match {len(rows)} rows × {len(cols)} columns")
    labels = _position_labels(tokens, np.union1d(rows, cols))
    q, k = np.meshgrid(rows, cols, indexing="ij")
    return pd.DataFrame(
        {
            "query_pos": q.ravel(),
            "key_pos": k.ravel(),
            "query": [labels[int(p)] for p in q.ravel()],
            "key": [labels[int(p)] for p in k.ravel()],
            "weight": np.asarray(block, dtype=np.float64).ravel(),
        }
    )


# How an attention map is coloured: at a thousand keys a row's weights are ~1/1000, flat grey on a 0–1 scale.
MAP_SCALES = {
    "log": "log₁₀ p (10⁻⁴ … 1)",
    "row": "p ÷ its row's largest p in the window",
    "linear": "p on 0 … 1",
}
LOG_FLOOR = 1e-4  # the log scale's lower end: weights below it (masked future keys: 0) take its colour


def map_shade(block_frame: pd.DataFrame, scale: str) -> pd.Series:
    """The value an attention map colours each cell by (see MAP_SCALES): the weight clipped to
    [LOG_FLOOR, 1] ("log"), the weight over the largest weight of its query row in the frame ("row"; a row
    of zeros stays 0), or the weight ("linear")."""
    weight = block_frame["weight"].astype(np.float64)
    if scale == "log":
        return weight.clip(lower=LOG_FLOOR, upper=1.0)
    if scale == "row":
        top = weight.groupby(block_frame["query_pos"]).transform("max")
        return (weight / top.where(top > 0)).fillna(0.0)
    if scale == "linear":
        return weight
    raise ValueError(f"scale must be one of {list(MAP_SCALES)}, got {scale!r}")


def _shade_colour(scale: str) -> alt.Color:
    """The colour of `map_shade`'s values: greys on a log or linear scale, legend named after MAP_SCALES."""
    if scale == "log":
        return alt.Color(
            "shade:Q",
            scale=alt.Scale(type="log", scheme="greys", domain=[LOG_FLOOR, 1]),
            legend=alt.Legend(title="p (log)", values=[1e-4, 1e-3, 1e-2, 1e-1, 1], format="~g"),
        )
    title = "p ÷ row max" if scale == "row" else "p"
    return alt.Color(
        "shade:Q", scale=alt.Scale(scheme="greys", domain=[0, 1]), legend=alt.Legend(title=title)
    )


def attention_map_chart(
    block_frame: pd.DataFrame, *, title: str | None = None, scale: str = "linear"
) -> alt.Chart:
    """Query × key heatmap of one head over a window (the cells of `attention_block_frame`).

    Queries run down y, keys along x, both in position order; the weight p_ij is row-normalised over *all*
    keys (a window's rows need not sum to 1), masked (future) keys are 0. Colour (`scale`, MAP_SCALES):
    "log" — log₁₀ p from LOG_FLOOR to 1, so weights of ~1/1000 over a thousand keys still differ; "row" —
    p over the largest p of its row in the window (each query's own pattern, whatever its spread);
    "linear" — p on 0–1. Tooltip: query, key, weight (always the weight itself). The caller chooses the
    window: the chart carries exactly the cells it is given.
    """
    data = block_frame[["query_pos", "key_pos", "query", "key", "weight"]].assign(
        shade=map_shade(block_frame, scale).to_numpy()
    )
    num_rows = int(data["query_pos"].nunique()) if len(data) else 0
    num_cols = int(data["key_pos"].nunique()) if len(data) else 0
    axis: dict[str, Any] = {"labelLimit": 90, "labelOverlap": True}
    return (
        alt.Chart(data)
        .mark_rect()
        .encode(
            x=alt.X(
                "key:N",
                sort=alt.EncodingSortField(field="key_pos", op="min"),
                axis=alt.Axis(title="key (pos:token)", labelAngle=-90, **axis),
            ),
            y=alt.Y(
                "query:N",
                sort=alt.EncodingSortField(field="query_pos", op="min"),
                axis=alt.Axis(title="query (pos:token)", **axis),
            ),
            color=_shade_colour(scale),
            tooltip=[
                alt.Tooltip("query:N"),
                alt.Tooltip("key:N"),
                alt.Tooltip("weight:Q", format=".4g"),
            ],
        )
        .properties(
            title=alt.Title(
                title or "Attention map",
                subtitle=f"{num_rows} queries × {num_cols} keys"
                + ("" if scale == "linear" else f" · colour = {MAP_SCALES[scale]}"),
            ),
            height=min(max(14 * num_rows, 160), 640),
            autosize=FIT_WIDTH,
        )
    )


def map_shade_matrix(block: np.ndarray, scale: str) -> np.ndarray:
    """`map_shade` of a whole block [R, C] at once: the weight clipped to [LOG_FLOOR, 1] ("log"), over its
    row's largest weight in the block ("row"; a row of zeros stays 0), or the weight ("linear")."""
    weight = np.asarray(block, dtype=np.float64)
    if scale == "log":
        return np.clip(weight, LOG_FLOOR, 1.0)
    if scale == "row":
        top = weight.max(axis=1, keepdims=True) if weight.size else weight
        return np.divide(weight, top, out=np.zeros_like(weight), where=top > 0)
    if scale == "linear":
        return weight
    raise ValueError(f"scale must be one of {list(MAP_SCALES)}, got {scale!r}")


def map_ramp(scale: str) -> ColourRamp:
    """The raster colours of `map_shade_matrix`'s values: greys, on a log scale for "log"."""
    if scale == "log":
        return ColourRamp.of("greys", (LOG_FLOOR, 1.0), log=True)
    return ColourRamp.of("greys", (0.0, 1.0))


def attention_map_raster(
    block: np.ndarray,
    rows: np.ndarray,
    cols: np.ndarray,
    tokens: pd.DataFrame,
    *,
    title: str | None = None,
    scale: str = "linear",
) -> alt.LayerChart:
    """`attention_map_chart` for windows of more than RASTER_ABOVE cells (one head over a whole 1000-token
    sequence): the block [R, C] (`AttentionCapture.block`) drawn as one image, queries down y, keys along x,
    both in position order, coloured as MAP_SCALES says; hover bins give the mean, min and max weight of
    their queries × keys (each cell's weight where a bin holds few); axes are positions labelled
    "pos:token" at Vega's ticks."""
    rows, cols = np.asarray(rows, dtype=np.int64), np.asarray(cols, dtype=np.int64)
    block = np.asarray(block, dtype=np.float64)
    if block.shape != (len(rows), len(cols)):
        raise ValueError(f"block {block.shape} does not match {len(rows)} rows × {len(cols)} columns")
    labels = _position_labels(tokens, np.union1d(rows, cols))
    row_labels = [labels[int(p)] for p in rows]
    col_labels = [labels[int(p)] for p in cols]
    legend = (
        alt.Legend(title="p (log)", values=[1e-4, 1e-3, 1e-2, 1e-1, 1], format="~g")
        if scale == "log"
        else alt.Legend(title="p ÷ row max" if scale == "row" else "p")
    )
    return raster_heatmap(
        map_shade_matrix(block, scale),
        map_ramp(scale),
        row_title="query",
        col_title="key",
        value_title="weight",
        row_labels=row_labels,
        col_labels=col_labels,
        x_axis=alt.Axis(title="key (pos:token)", labelAngle=-90, labelLimit=90, **_label_ticks(col_labels)),
        y_axis=alt.Axis(title="query (pos:token)", labelLimit=90, **_label_ticks(row_labels)),
        legend=legend,
        height=min(max(len(rows), 160), 640),
        hover=block,
        autosize=FIT_WIDTH,
        title=alt.Title(
            title or "Attention map",
            subtitle=f"{len(rows)} queries × {len(cols)} keys, drawn as an image; hover for the weights"
            + ("" if scale == "linear" else f" · colour = {MAP_SCALES[scale]}"),
        ),
    )


def _label_ticks(labels: list[str]) -> dict:
    """Axis settings labelling whole positions of a raster axis by `labels` (Vega picks the ticks)."""
    items = ",".join(json.dumps(str(label)) for label in labels)  # JS string literals, quotes escaped
    whole = f"datum.value >= 0 && datum.value < {len(labels)} && datum.value % 1 == 0"
    return {"tickMinStep": 1, "labelOverlap": True, "labelExpr": f"{whole} ? [{items}][datum.value] : ''"}


def attention_row_frame(
    row: np.ndarray, tokens: pd.DataFrame, *, pos: int, max_keys: int = 200
) -> pd.DataFrame:
    """The last `max_keys` keys up to and including `pos` of one token's attention row, as a tidy frame.

    Input: `AttentionCapture.row(layer, head, seq, pos)` [L] and the tokens of that sequence (pos, token).
    Output: key_pos, key (label), weight, distance (pos − key_pos). The mass left out is 1 − Σ weight of the
    returned rows (the keys further back).
    """
    if max_keys < 1:
        raise ValueError(f"max_keys must be >= 1, got {max_keys}")
    lo = max(0, int(pos) - max_keys + 1)
    keys = np.arange(lo, min(int(pos) + 1, len(row)))
    labels = _position_labels(tokens, keys)
    return pd.DataFrame(
        {
            "key_pos": keys,
            "key": [labels[int(k)] for k in keys],
            "weight": np.asarray(row, dtype=np.float64)[keys],
            "distance": int(pos) - keys,
        }
    )


def attention_row_chart(row_frame: pd.DataFrame, *, title: str | None = None) -> alt.Chart:
    """Bars of one token's attention over the keys before it (`attention_row_frame`), in position order.

    Height = attention weight p_j; the subtitle gives the mass shown (less than 1 when earlier keys were
    left out of the window). Tooltip: key, distance, weight.
    """
    shown = float(row_frame["weight"].sum()) if len(row_frame) else 0.0
    return (
        alt.Chart(row_frame)
        .mark_bar(color="#4c78a8")
        .encode(
            x=alt.X(
                "key:N",
                sort=alt.EncodingSortField(field="key_pos", op="min"),
                axis=alt.Axis(title="key (pos:token)", labelAngle=-90, labelLimit=90, labelOverlap=True),
            ),
            y=alt.Y("weight:Q", scale=alt.Scale(domain=[0, 1]), title="attention p"),
            tooltip=[
                alt.Tooltip("key:N"),
                alt.Tooltip("distance:Q", title="tokens back"),
                alt.Tooltip("weight:Q", format=".4f"),
            ],
        )
        .properties(
            title=alt.Title(
                title or "Attention row", subtitle=f"{len(row_frame)} keys shown, holding {shown:.1%} of it"
            ),
            height=200,
            autosize=FIT_WIDTH,
        )
    )


def kv_whatif_heatmap(whatif: pd.DataFrame, *, title: str | None = None) -> alt.LayerChart:
    """Layer × head heatmap of the attention mass a head would lose under a windowed KV cache.

    Input: `moeviz.whatif.kv_cache_whatif(attention, window, global_tokens)` (layer, head, mean_lost,
    p95_lost, max_lost, ...). Colour = mean mass lost per token (0 = the window + global tokens keep
    everything); the cell text is that share in percent; tooltip adds p95 and max.
    """
    data = whatif[["layer", "head", "mean_lost", "p95_lost", "max_lost"]].astype(
        {"layer": int, "head": int, "mean_lost": float, "p95_lost": float, "max_lost": float}
    )
    data = data.assign(text=[f"{v:.0%}" for v in data["mean_lost"]])
    num_layers = int(data["layer"].nunique()) if len(data) else 1
    base = alt.Chart().encode(
        x=alt.X("head:O", axis=alt.Axis(title="head", labelAngle=0)),
        y=alt.Y("layer:O", axis=alt.Axis(title="layer")),
        tooltip=[
            alt.Tooltip("layer:O"),
            alt.Tooltip("head:O"),
            alt.Tooltip("mean_lost:Q", format=".2%", title="mean lost"),
            alt.Tooltip("p95_lost:Q", format=".2%", title="p95 lost"),
            alt.Tooltip("max_lost:Q", format=".2%", title="max lost"),
        ],
    )
    cells = base.mark_rect(stroke="white").encode(
        color=alt.Color(
            "mean_lost:Q", scale=alt.Scale(scheme="reds", domain=[0, 1]), legend=alt.Legend(title="lost")
        )
    )
    text = base.mark_text(fontSize=10, color="black").encode(text=alt.Text("text:N"))
    return layered_chart(
        cells,
        text,
        data=data,
        title=alt.Title(title or "Attention mass lost", subtitle="mean over tokens; hover for p95 and max"),
        height=min(max(24 * num_layers, 96), 640),
        autosize=FIT_WIDTH,
    )
