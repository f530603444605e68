"""Load and balance views over all MoE layers: the layer × expert load heatmap and per-layer indicators."""

from __future__ import annotations

import altair as alt
import numpy as np
import pandas as pd

from moeviz.analysis.losses import AUX_LOSS_FORMS
from moeviz.charts._common import FIT_WIDTH, layer_labels, layered_chart, log2_fold, log2_fold_colour

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
            autosize=FIT_WIDTH,
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
            # trimmed labels: an indicator at 0 in every layer (no dead expert) otherwise reads "0.000000"
            y=alt.Y("value:Q", title=metric, axis=alt.Axis(format="~g")),
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
    return layered_chart(bars, uniform, title=title or metric, height=180, autosize=FIT_WIDTH)


def aux_loss_chart(losses: pd.DataFrame, *, title: str | None = None) -> alt.LayerChart:
    """One row per layer: each balancing loss as a multiple of its balanced value (1 = even load), one point
    per form, with a rule at 1.

    Input: `moeviz.analysis.aux_loss_frame(...)`. The Megatron-Core form is left out: its ratio equals the
    top-k form's.
    Right of the rule = the experts that get most tokens also get most router probability (uneven load,
    which the loss penalises); left of it is possible only when the busiest experts get little probability.
    """
    forms = [c for c in AUX_LOSS_FORMS if c != "aux_loss_megatron"]
    rows = []
    labels = layer_labels(losses)
    for (_, row), label in zip(losses.iterrows(), labels, strict=True):
        for column in forms:
            balanced = float(row[f"{column}_balanced"])
            rows.append(
                {
                    "row": label,
                    "layer": int(row["layer"]),
                    "form": column,
                    "value": float(row[column]),
                    "balanced": balanced,
                    "ratio": float(row[column]) / balanced,
                }
            )
    data = pd.DataFrame(rows, columns=["row", "layer", "form", "value", "balanced", "ratio"])
    y = alt.Y("row:O", title="MoE layer", sort=alt.EncodingSortField("layer"))
    points = (
        alt.Chart(data)
        .mark_point(filled=True, size=60, opacity=0.85)
        .encode(
            x=alt.X(
                "ratio:Q", title="loss ÷ its balanced value (1 = even load)", scale=alt.Scale(zero=False)
            ),
            y=y,
            color=alt.Color("form:N", scale=alt.Scale(domain=forms), legend=alt.Legend(orient="bottom")),
            shape=alt.Shape("form:N", scale=alt.Scale(domain=forms), legend=None),
            tooltip=[
                alt.Tooltip("row:O", title="layer"),
                alt.Tooltip("form:N"),
                alt.Tooltip("value:Q", format=".4f", title="loss"),
                alt.Tooltip("balanced:Q", format="g", title="balanced value"),
                alt.Tooltip("ratio:Q", format=".3f", title="÷ balanced"),
            ],
        )
    )
    rule = (
        alt.Chart(pd.DataFrame({"ratio": [1.0]}))
        .mark_rule(color="#e4572e", strokeDash=[4, 2], strokeWidth=2)
        .encode(x="ratio:Q")
    )
    layers = int(data["row"].nunique()) if len(data) else 1
    return layered_chart(
        rule,
        points,
        title=alt.Title(
            title or "Balancing losses per layer",
            subtitle="each loss ÷ its value under perfectly even load; dashed line = even load",
        ),
        height=min(max(22 * layers, 100), 900),
        autosize=FIT_WIDTH,
    )
