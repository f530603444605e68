"""Comparison views of two traces of the same text: routing agreement per layer, the load shift, and each
model's load heatmap sized for half a column (A beside B)."""

from __future__ import annotations

from typing import Any

import altair as alt
import numpy as np
import pandas as pd

from moeviz.charts._common import FIT_WIDTH
from moeviz.charts.load import load_heatmap

AGREEMENT_SERIES = {
    "saturation_topk": "top-k overlap |Sᵃ∩Sᵇ|/|Sᵇ|",
    "saturation_top1": "same top-1",
    "jaccard": "Jaccard |Sᵃ∩Sᵇ|/|Sᵃ∪Sᵇ|",
}


def agreement_chart(agreement: pd.DataFrame, *, title: str | None = None) -> alt.Chart:
    """Per layer, how much of model B's routing model A shares: grouped bars in [0, 1] (1 = identical).

    Input: `moeviz.analysis.routing_agreement_frame(a, b)` (columns layer, site, tokens, saturation_topk,
    saturation_top1, jaccard).
    """
    data = agreement.melt(id_vars=["site", "layer"], value_vars=list(AGREEMENT_SERIES), var_name="metric")
    data["metric"] = data["metric"].map(AGREEMENT_SERIES)
    data["value"] = data["value"].astype(np.float64)
    order = list(AGREEMENT_SERIES.values())
    return (
        alt.Chart(data)
        .mark_bar()
        .encode(
            x=alt.X("layer:O", title="MoE layer", axis=alt.Axis(labelAngle=0)),
            xOffset=alt.XOffset("metric:N", sort=order),
            y=alt.Y("value:Q", scale=alt.Scale(domain=[0, 1]), title="agreement"),
            color=alt.Color("metric:N", sort=order, title=None),
            tooltip=[alt.Tooltip("layer:O"), alt.Tooltip("metric:N"), alt.Tooltip("value:Q", format=".3f")],
        )
        .properties(title=title or "Routing agreement (A vs B)", height=220, autosize=FIT_WIDTH)
    )


def load_shift_heatmap(drift: pd.DataFrame, *, title: str | None = None) -> alt.Chart:
    """Layer × expert heatmap of the change in load from A to B (tokens), white = unchanged.

    Input: `moeviz.analysis.expert_drift_frame(a, b)` (columns layer, site, expert, load_a, load_b,
    load_change, share_a, share_b, retained, drift). Red = B sends the expert more tokens, blue = fewer;
    the scale is symmetric around 0. Tooltip adds the share of A's tokens B keeps (retained) and drift.
    """
    data = drift[
        [
            "site",
            "layer",
            "expert",
            "load_a",
            "load_b",
            "load_change",
            "share_a",
            "share_b",
            "retained",
            "drift",
        ]
    ].copy()
    data = data.astype(
        {"share_a": np.float64, "share_b": np.float64, "retained": np.float64, "drift": np.float64}
    )
    limit = float(np.abs(data["load_change"]).max()) if len(data) else 1.0
    layers = int(data["layer"].nunique()) if len(data) else 1
    return (
        alt.Chart(data)
        .mark_rect(stroke="white", strokeWidth=0.5)
        .encode(
            x=alt.X("expert:O", axis=alt.Axis(labelAngle=0)),
            y=alt.Y("layer:O", title="MoE layer"),
            color=alt.Color(
                "load_change:Q",
                scale=alt.Scale(
                    scheme="redblue", reverse=True, domain=[-max(limit, 1), max(limit, 1)], domainMid=0
                ),
                title="Δ tokens (B − A)",
            ),
            tooltip=[
                alt.Tooltip("layer:O"),
                alt.Tooltip("expert:O"),
                alt.Tooltip("load_a:Q", title="tokens in A"),
                alt.Tooltip("load_b:Q", title="tokens in B"),
                alt.Tooltip("load_change:Q", title="B − A"),
                alt.Tooltip("retained:Q", format=".2f", title="A's tokens kept"),
                alt.Tooltip("drift:Q", format=".2f", title="drift (1 − Jaccard)"),
            ],
        )
        .properties(
            title=title or "Load shift A → B", height=min(max(26 * layers, 100), 700), autosize=FIT_WIDTH
        )
    )


# The utilisation legend under a half-column heatmap: its five labels in 170 px (a 1280 px page gives each
# of A and B ~330 px, a 900 px one ~200 px), its title whole.
HALF_LEGEND: dict[str, Any] = dict(
    title="log₂ utilisation (0 = fair share)",
    orient="bottom",
    direction="horizontal",
    values=[-3, -1, 0, 1, 3],
    gradientLength=170,
    labelOverlap=False,
    titleLimit=300,
    titleOrient="top",
)


def side_by_side_load_heatmap(expert_balance: pd.DataFrame, *, title: str) -> alt.Chart:
    """`load_heatmap` for half a column (Compare's A beside B): its colour legend under the cells,
    horizontal. Beside the cells it took ~100 px of a ~330 px column and was cut: its title at the right
    edge, its lowest label at the bottom of a few layers' short chart (100 px against a 160 px gradient).

    Input: `moeviz.analysis.expert_balance_frame(trace)` rows, as for `load_heatmap`.
    """
    chart = load_heatmap(expert_balance, title=title)
    chart.encoding.color["legend"] = alt.Legend(**HALF_LEGEND)
    return chart
