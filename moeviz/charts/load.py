"""Load and balance views over all MoE layers: the layer × expert load heatmap and per-layer indicators."""

from __future__ import annotations

import altair as alt
import numpy as np
import pandas as pd

from moeviz.charts._common import layer_labels, log2_fold, log2_fold_colour
from moeviz.charts.routing import _FIT_WIDTH

# What each balance indicator reads when the load is perfectly uniform (E = experts of the layer).
UNIFORM_VALUE = {
    "load_entropy": lambda e: 1.0,
    "effective_experts": lambda e: float(e),
    "max_share": lambda e: 1.0 / e,
    "max_vio": lambda e: 0.0,
    "cv": lambda e: 0.0,
    "cv_unbiased": lambda e: 0.0,
    "gini": lambda e: 0.0,
    "gini_megatron": lambda e: -1.0 / e,
    "jain": lambda e: 1.0,
    "dead_fraction": lambda e: 0.0,
    "dropped_fraction": lambda e: 0.0,
}


def load_heatmap(expert_balance: pd.DataFrame, *, title: str | None = None) -> alt.Chart:
    """Layer × expert heatmap of utilisation (count / fair share), white at the fair share (1).

    Input: `moeviz.analysis.expert_balance_frame(trace)` (columns layer, site, expert, count, share,
    utilisation, dead). Red = more than its fair share, blue = less; a dead expert (count 0) is the
    deepest blue. The colour scale is symmetric in log2 (½× and 2× equally strong), clipped at 8×.
    """
    data = expert_balance[["site", "layer", "expert", "count", "share", "utilisation", "dead"]].copy()
    data["log2_util"] = log2_fold(data["utilisation"])
    data["row"] = layer_labels(data)
    layers = int(data["row"].nunique()) if len(data) else 1
    return (
        alt.Chart(data)
        .mark_rect(stroke="white", strokeWidth=0.5)
        .encode(
            x=alt.X("expert:O", axis=alt.Axis(labelAngle=0)),
            y=alt.Y("row:O", title="MoE layer", sort=alt.EncodingSortField("layer")),
            color=log2_fold_colour("log2_util", "log₂ utilisation"),
            tooltip=[
                alt.Tooltip("layer:O"),
                alt.Tooltip("expert:O"),
                alt.Tooltip("count:Q", title="tokens"),
                alt.Tooltip("share:Q", format=".1%"),
                alt.Tooltip("utilisation:Q", format=".2f", title="utilisation (1 = fair)"),
                alt.Tooltip("dead:N"),
            ],
        )
        .properties(
            title=alt.Title(
                title or "Load per layer and expert", subtitle="white = fair share, red = over, blue = under"
            ),
            height=min(max(26 * layers, 100), 700),
            autosize=_FIT_WIDTH,
        )
    )


def balance_chart(balance: pd.DataFrame, metric: str, *, title: str | None = None) -> alt.LayerChart:
    """Bars of one balance indicator per layer, with a dashed tick at its value under uniform load.

    Input: `moeviz.analysis.balance_frame(trace)` (columns layer, site, experts and the indicator
    `metric`, one of UNIFORM_VALUE). The uniform reference depends on E (e.g. max_share = 1/E).
    """
    if metric not in UNIFORM_VALUE:
        raise ValueError(f"no uniform reference for {metric!r}; known: {sorted(UNIFORM_VALUE)}")
    data = balance[["site", "layer", "experts", metric]].rename(columns={metric: "value"}).copy()
    data["value"] = data["value"].astype(np.float64)
    data["uniform"] = [UNIFORM_VALUE[metric](int(e)) for e in data["experts"]]
    x = alt.X("layer:O", title="MoE layer", axis=alt.Axis(labelAngle=0))
    bars = (
        alt.Chart(data)
        .mark_bar(color="#4c78a8")
        .encode(
            x=x,
            y=alt.Y("value:Q", title=metric),
            tooltip=[
                alt.Tooltip("layer:O"),
                alt.Tooltip("value:Q", format=".3f", title=metric),
                alt.Tooltip("uniform:Q", format=".3f"),
            ],
        )
    )
    uniform = (
        alt.Chart(data)
        .mark_tick(color="#e4572e", thickness=2, strokeDash=[4, 2], size=40)
        .encode(x=x, y="uniform:Q", tooltip=[alt.Tooltip("uniform:Q", format=".3f", title="uniform load")])
    )
    return alt.layer(bars, uniform).properties(title=title or metric, height=180, autosize=_FIT_WIDTH)
