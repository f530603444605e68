"""Architecture views: the balancing bias vector of each layer."""

from __future__ import annotations

import altair as alt
import numpy as np
import pandas as pd


def bias_chart(bias: pd.DataFrame, *, title: str | None = None) -> alt.FacetChart:
    """Bars of the balancing bias b_e added to the router scores for selection, one row per layer.

    Input: `moeviz.architecture.bias_frame(trace)` (columns site, layer, expert, bias). Positive bias
    (orange) makes an expert easier to select, negative (blue) harder.
    """
    data = bias[["site", "layer", "expert", "bias"]].astype({"bias": np.float64}).reset_index(drop=True)
    data["sign"] = np.where(data["bias"] >= 0, "+", "−")
    return (
        alt.Chart(data)
        .mark_bar()
        .encode(
            x=alt.X("expert:O", axis=alt.Axis(labelAngle=0)),
            y=alt.Y("bias:Q", title="bias"),
            color=alt.Color(
                "sign:N", scale=alt.Scale(domain=["+", "−"], range=["#f58518", "#4c78a8"]), legend=None
            ),
            tooltip=[alt.Tooltip("layer:O"), alt.Tooltip("expert:O"), alt.Tooltip("bias:Q", format=".4f")],
        )
        .properties(height=110, width=600)
        .facet(row=alt.Row("layer:O", title="MoE layer"))
        .properties(title=title or "Balancing bias per expert")
    )
