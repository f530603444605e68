"""Engine diff views (`moeviz.analysis.engine_diff.EngineDiff`): where two routings of the same tokens choose
different experts — per layer, per (layer, position), per router-margin quartile and per token.

Each function takes one of EngineDiff's frames and draws its values; nothing is derived beyond reshaping and,
for long inputs, summing neighbouring position bins (pairs and mismatched are summed, so totals survive).
Every view stays legible at 58+ MoE layers and any number of experts: layers sit on a quantitative axis whose
ticks Vega spaces itself (each labelled with its layer), and no view has one mark per expert.
"""

from __future__ import annotations

import math

import altair as alt
import numpy as np
import pandas as pd

from moeviz.charts._common import FIT_WIDTH, INK, PAPER, layered_chart
from moeviz.charts.routing import (
    _VISIBLE_WHITESPACE,
    STRIP_WIDTH,
    _labelled,
    _window_subtitle,
    token_window,
)
from moeviz.charts.scale import _layer_rows, _position_axis

# per-layer differences, each 0 for identical routing and at most 1 (line order = legend order)
LAYER_METRICS = {
    "router_mismatch": "router mismatch",
    "top1_mismatch": "top-1 mismatch",
    "jaccard_distance": "1 − Jaccard",
    "tv": "router TV distance",
}
MAX_POSITION_BINS = 100
POSITION_COLUMNS = [
    "layer",
    "site",
    "pos_start",
    "pos_end",
    "pairs",
    "mismatched",
    "router_mismatch",
]  # position bins per layer in the heatmap
NOT_PAIRED = "#bbbbbb"  # tokens one side did not route
# mismatch colours: 0 near white (nothing differs), darker the more differs; black text readable on each
MISMATCH_RANGE = ["#fff5eb", "#fdae6b", "#f16913", "#d94801"]


def _rate_scale(values: pd.Series, headroom: float = 1.0) -> alt.Scale:
    """A rate axis from 0 that stays readable when every rate is 0 (at least 0 to 1%); `headroom` × the
    largest rate on top (room for labels over the bars)."""
    finite = values.to_numpy(dtype=np.float64)
    finite = finite[np.isfinite(finite)]
    peak = float(finite.max()) if len(finite) else 0.0
    return alt.Scale(domain=[0, max(peak * headroom, 0.01)])


def _integer_ticks(top: int, most: int = 6) -> list[int]:
    """At most about `most` whole numbers from 0 to `top` (both included), evenly spaced."""
    step = max(1, math.ceil(top / (most - 1)))
    return sorted({*range(0, top, step), top})


def layer_mismatch_chart(layers: pd.DataFrame, *, title: str | None = None) -> alt.LayerChart:
    """Per MoE layer, how differently A and B route: router mismatch (share of tokens whose top-k sets
    differ), top-1 mismatch, 1 − mean Jaccard of the sets and, where both sides have router logits, the
    total-variation distance of the router distributions — all 0 for identical routing. A line per metric
    over depth, a dot per layer; KL in the tooltip.

    Input: `EngineDiff.layers` (columns layer, site, pairs, mismatched, router_mismatch, top1_mismatch,
    jaccard, kl, tv). A metric that is NaN at a layer (top-1 where a side does not rank its slots; TV and
    KL without logits) is not drawn there. Layers are positions on a quantitative axis labelled with the
    layer (and site where several): any number of layers, no label dropped or overlapping.
    """
    rows, labels = _layer_rows(layers)
    base = pd.DataFrame(
        {
            "row": rows,
            "layer_label": [labels[r] for r in rows],
            "pairs": layers["pairs"].to_numpy(dtype=np.int64),
            "mismatched": layers["mismatched"].to_numpy(dtype=np.int64),
            "kl": layers["kl"].to_numpy(dtype=np.float64),
        }
    )
    values = {
        "router_mismatch": layers["router_mismatch"].to_numpy(dtype=np.float64),
        "top1_mismatch": layers["top1_mismatch"].to_numpy(dtype=np.float64),
        "jaccard_distance": 1.0 - layers["jaccard"].to_numpy(dtype=np.float64),
        "tv": layers["tv"].to_numpy(dtype=np.float64),
    }
    parts = [base.assign(metric=LAYER_METRICS[name], value=value) for name, value in values.items()]
    data = pd.concat(parts, ignore_index=True)
    data = data[np.isfinite(data["value"].to_numpy())].reset_index(drop=True)
    names = [name for name in LAYER_METRICS.values() if name in set(data["metric"])]
    x = alt.X(
        "row:Q",
        scale=alt.Scale(domain=[-0.5, max(len(labels), 1) - 0.5], nice=False, zero=False),
        axis=_position_axis("MoE layer", labels),
    )
    y = alt.Y(
        "value:Q",
        title="difference (0 = identical)",
        axis=alt.Axis(format="%"),
        scale=_rate_scale(data["value"]),
    )
    colour = alt.Color(
        "metric:N",
        scale=alt.Scale(domain=names, scheme="tableau10"),
        sort=names,
        legend=alt.Legend(title=None, orient="bottom", direction="horizontal", columns=2, labelLimit=200),
    )
    tooltip = [
        alt.Tooltip("layer_label:N", title="MoE layer"),
        alt.Tooltip("metric:N"),
        alt.Tooltip("value:Q", format=".3%"),
        alt.Tooltip("mismatched:Q", title="(token, layer) differing"),
        alt.Tooltip("pairs:Q", title="(token, layer) compared"),
        alt.Tooltip("kl:Q", format=".3g", title="router KL(A‖B)"),
    ]
    lines = alt.Chart().mark_line(strokeWidth=1.5).encode(x=x, y=y, color=colour, detail="metric:N")
    dots = alt.Chart().mark_circle(size=36, opacity=1).encode(x=x, y=y, color=colour, tooltip=tooltip)
    return layered_chart(
        lines,
        dots,
        data=data,
        title=alt.Title(
            title or "Routing difference per MoE layer", subtitle="0 = A and B route identically"
        ),
        height=240,
        autosize=FIT_WIDTH,
    )


def rebinned_positions(layer_position: pd.DataFrame, max_bins: int = MAX_POSITION_BINS) -> pd.DataFrame:
    """`EngineDiff.layer_position_frame()` with neighbouring position bins summed so that each layer has at
    most `max_bins` (pairs and mismatched summed, router_mismatch = mismatched / pairs of the merged bin;
    pos_start / pos_end the merged range). Unchanged when it already fits."""
    if layer_position.empty:
        return layer_position.copy()
    width = int(layer_position["pos_end"].iloc[0] - layer_position["pos_start"].iloc[0] + 1)
    span = int(layer_position["pos_end"].max()) + 1
    factor = max(1, math.ceil(math.ceil(span / width) / max_bins))
    if factor == 1:
        return layer_position.reset_index(drop=True)
    merged = width * factor
    grouped = (
        layer_position.assign(bin=layer_position["pos_start"].to_numpy() // merged)
        .groupby(["layer", "site", "bin"], sort=True)
        .agg(
            pos_start=("pos_start", "min"),
            pos_end=("pos_end", "max"),
            pairs=("pairs", "sum"),
            mismatched=("mismatched", "sum"),
        )
        .reset_index()
        .drop(columns="bin")
    )
    grouped["router_mismatch"] = grouped["mismatched"] / grouped["pairs"]
    return grouped


def position_heatmap(
    layer_position: pd.DataFrame, *, max_bins: int = MAX_POSITION_BINS, title: str | None = None
) -> alt.Chart:
    """MoE layer × token position heatmap of the router mismatch (share of the cell's (token, layer) pairs
    whose expert sets differ): where in depth and in the sequence A and B part ways.

    Input: `EngineDiff.layer_position_frame()` (columns layer, site, pos_start, pos_end, pairs,
    mismatched, router_mismatch; one row per layer and position bin that holds a pair). Long inputs: bins
    merged to at most `max_bins` per layer (`rebinned_positions`), so the chart holds at most
    layers × max_bins cells. Cell edges are computed here (no Vega expression per cell); layers are
    positions on a quantitative axis labelled with the layer.
    """
    binned = rebinned_positions(layer_position, max_bins).reset_index(drop=True)
    if binned.empty:  # no layer paired a token (the frame may then have no columns)
        binned = pd.DataFrame({c: [] for c in POSITION_COLUMNS})
    rows, labels = _layer_rows(binned) if len(binned) else (np.zeros(0, np.int64), [])
    data = pd.DataFrame(
        {
            "layer_label": [labels[r] for r in rows],
            **{
                c: binned[c].to_numpy(dtype=np.int64) for c in ("pos_start", "pos_end", "pairs", "mismatched")
            },
            "router_mismatch": binned["router_mismatch"].to_numpy(dtype=np.float64),
        }
    )
    data["x0"] = data["pos_start"] - 0.5
    data["x1"] = data["pos_end"] + 0.5
    data["y0"], data["y1"] = rows - 0.5, rows + 0.5
    width = int(data["pos_end"].iloc[0] - data["pos_start"].iloc[0] + 1) if len(data) else 1
    span = int(data["pos_end"].max()) + 1 if len(data) else 1
    peak = float(data["router_mismatch"].max()) if len(data) else 0.0
    position = "token position" if width == 1 else f"token position (bins of {width})"
    return (
        alt.Chart(data)
        .mark_rect(stroke=PAPER, strokeWidth=0.3 if len(labels) > 20 else 1)
        .encode(
            x=alt.X(
                "x0:Q",
                scale=alt.Scale(domain=[-0.5, span - 0.5], nice=False, zero=False),
                axis=alt.Axis(title=position, tickMinStep=1, grid=False, format="d"),
            ),
            x2=alt.X2("x1:Q"),
            y=alt.Y(
                "y0:Q",
                scale=alt.Scale(
                    domain=[-0.5, max(len(labels), 1) - 0.5], reverse=True, nice=False, zero=False
                ),
                axis=_position_axis("MoE layer", labels, labelFontSize=9 if len(labels) > 20 else 11),
            ),
            y2=alt.Y2("y1:Q"),
            color=alt.Color(
                "router_mismatch:Q",
                scale=alt.Scale(range=MISMATCH_RANGE, domain=[0, max(peak, 0.01)], interpolate="lab"),
                legend=alt.Legend(
                    title="router mismatch",
                    format="%",
                    orient="bottom",
                    direction="horizontal",
                    gradientLength=200,
                ),
            ),
            tooltip=[
                alt.Tooltip("layer_label:N", title="MoE layer"),
                alt.Tooltip("pos_start:Q", title="from position"),
                alt.Tooltip("pos_end:Q", title="to position"),
                alt.Tooltip("mismatched:Q", title="(token, layer) differing"),
                alt.Tooltip("pairs:Q", title="(token, layer) compared"),
                alt.Tooltip("router_mismatch:Q", format=".2%", title="router mismatch"),
            ],
        )
        .properties(
            title=alt.Title(
                title or "Router mismatch by layer and position",
                subtitle=f"{len(labels)} MoE layers × {len(data) // max(len(labels), 1)} position bins",
            ),
            height=min(max(14 * len(labels), 120), 720),
            autosize=FIT_WIDTH,
        )
    )


def margin_quartile_chart(quartiles: pd.DataFrame, *, side: str, title: str | None = None) -> alt.LayerChart:
    """Bars of the router mismatch per router-margin quartile (1 = the lowest margins, where the router
    hesitated): a difference caused by precision concentrates in quartile 1. The margins are those of
    `side` ("A" or "B", the side whose router logits are known), quartiles taken per layer then pooled.

    Input: `EngineDiff.margin_quartile_frame()` (columns quartile, margin_low, margin_high, pairs,
    mismatched, router_mismatch). Each bar is labelled "mismatched / pairs".
    """
    data = quartiles[
        ["quartile", "margin_low", "margin_high", "pairs", "mismatched", "router_mismatch"]
    ].copy()
    data = data.astype({"margin_low": np.float64, "margin_high": np.float64, "router_mismatch": np.float64})
    data["label"] = [
        f"{int(m):,} / {int(p):,}" for m, p in zip(data["mismatched"], data["pairs"], strict=True)
    ]
    x = alt.X(
        "quartile:O", title=f"router margin quartile of {side} (1 = lowest)", axis=alt.Axis(labelAngle=0)
    )
    y = alt.Y(
        "router_mismatch:Q",
        title="router mismatch",
        axis=alt.Axis(format="%"),
        scale=_rate_scale(data["router_mismatch"], headroom=1.15),
    )
    tooltip = [
        alt.Tooltip("quartile:O"),
        alt.Tooltip("margin_low:Q", format=".4g", title="margin from"),
        alt.Tooltip("margin_high:Q", format=".4g", title="margin to"),
        alt.Tooltip("mismatched:Q", title="(token, layer) differing"),
        alt.Tooltip("pairs:Q", title="(token, layer) compared"),
        alt.Tooltip("router_mismatch:Q", format=".2%", title="router mismatch"),
    ]
    bars = alt.Chart().mark_bar(color="#e4572e").encode(x=x, y=y, tooltip=tooltip)
    text = (
        alt.Chart()
        .mark_text(dy=-6, baseline="bottom", fontSize=11, color=INK)
        .encode(x=x, y=y, text=alt.Text("label:N"))
    )
    return layered_chart(
        bars,
        text,
        data=data,
        title=alt.Title(
            title or "Router mismatch by router-margin quartile",
            subtitle=f"margins of {side}; bars: differing / compared",
        ),
        height=220,
        autosize=FIT_WIDTH,
    )


def routers_per_token_chart(routers: pd.DataFrame, *, title: str | None = None) -> alt.Chart:
    """Bars of how many tokens have their expert set differ in 0, 1, 2, … MoE layers (routers differing per
    token): the distribution whose mean and non-zero share the headline gives.

    Input: `EngineDiff.routers_frame()` (columns routers, tokens, fraction; one row per count 0 … layers).
    The axis ends at the largest count any token has (the rows above it hold no token and are left out);
    it is quantitative (any number of layers, no label dropped), bar edges computed here.
    """
    data = routers[["routers", "tokens", "fraction"]].copy()
    held = data.loc[data["tokens"] > 0, "routers"]
    top = max(int(held.max()) if len(held) else 0, 1)
    data = data[data["routers"] <= top].reset_index(drop=True)
    data["fraction"] = data["fraction"].astype(np.float64)
    data["x0"], data["x1"] = data["routers"] - 0.4, data["routers"] + 0.4
    return (
        alt.Chart(data)
        .mark_rect(color="#4c78a8")
        .encode(
            x=alt.X(
                "x0:Q",
                scale=alt.Scale(domain=[-0.5, top + 0.5], nice=False, zero=False),
                axis=alt.Axis(
                    title="MoE layers whose expert set differs", tickMinStep=1, format="d", grid=False
                ),
            ),
            x2=alt.X2("x1:Q"),
            y=alt.Y("tokens:Q", title="tokens"),
            y2=alt.Y2(datum=0),
            tooltip=[
                alt.Tooltip("routers:Q", title="layers differing"),
                alt.Tooltip("tokens:Q"),
                alt.Tooltip("fraction:Q", format=".1%", title="share of tokens"),
            ],
        )
        .properties(
            title=alt.Title(
                title or "Routers differing per token", subtitle=f"of {len(routers) - 1} MoE layers"
            ),
            height=180,
            autosize=FIT_WIDTH,
        )
    )


def routers_strip_chart(
    tokens: pd.DataFrame,
    *,
    num_layers: int,
    max_tokens: int = 400,
    start: int = 0,
    per_line: int = STRIP_WIDTH,
    title: str | None = None,
) -> alt.LayerChart:
    """The tokens as a strip (as the Routing page's), each coloured by the number of MoE layers where A's
    and B's expert sets differ: white-orange 0, darker the more layers; grey where the token was not paired
    (one side did not route it).

    Input: `EngineDiff.token_frame()` (columns seq, pos, token_id, token, routers_differing; −1 = not
    paired). At most `max_tokens` tokens (window [start, start + max_tokens) in row order), two marks per
    token; tokens wrap after `per_line`. The colour scale runs from 0 to the most layers any token of the
    window differs in (at least 1), out of `num_layers`.
    """
    frame = tokens.reset_index(drop=True)
    lo, hi = token_window(len(frame), max_tokens=max_tokens, start=start)
    data = frame.iloc[lo:hi][["seq", "pos", "token", "routers_differing"]].reset_index(drop=True)
    data["routers_differing"] = data["routers_differing"].astype(np.int64)
    data["label"] = _labelled(data) if len(data) else []
    data["text"] = data["token"].astype(str).str.translate(_VISIBLE_WHITESPACE).str.slice(0, 10)
    data["slot"] = np.arange(len(data)) % per_line
    data["line"] = np.arange(len(data)) // per_line + lo // per_line
    data["differing"] = np.where(
        data["routers_differing"] >= 0,
        data["routers_differing"].astype(str) + f" of {num_layers}",
        "not paired",
    )
    peak = int(data["routers_differing"].max()) if len(data) else 0
    colour = alt.condition(
        "datum.routers_differing < 0",
        alt.value(NOT_PAIRED),
        alt.Color(
            "routers_differing:Q",
            scale=alt.Scale(range=MISMATCH_RANGE, domain=[0, max(peak, 1)], interpolate="lab"),
            legend=alt.Legend(
                title="MoE layers differing",
                orient="bottom",
                format="d",
                values=_integer_ticks(max(peak, 1)),
                gradientLength=200,
            ),
        ),
    )
    base = alt.Chart().encode(
        x=alt.X("slot:O", axis=None),
        y=alt.Y("line:O", axis=None),
        tooltip=[
            alt.Tooltip("label:N", title="token"),
            alt.Tooltip("differing:N", title="layers whose sets differ"),
        ],
    )
    boxes = base.mark_rect(stroke=PAPER, strokeWidth=2, cornerRadius=3).encode(color=colour)
    limit = alt.ExprRef(expr=f"max(width / {per_line} - 6, 8)")  # a label never spills into its neighbour
    text = base.mark_text(fontSize=12, color="black", limit=limit).encode(text=alt.Text("text:N"))
    lines = int(data["line"].nunique()) if len(data) else 1
    return layered_chart(
        boxes,
        text,
        data=data,
        title=alt.Title(
            title or "Tokens by MoE layers whose expert sets differ",
            subtitle=_window_subtitle(lo, hi, len(frame)),
        ),
        height=min(28 * lines, 900),
        autosize=FIT_WIDTH,
    )
