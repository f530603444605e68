"""Attribution views: a token strip coloured by attribution, and expert importance beside load."""

from __future__ import annotations

import altair as alt
import pandas as pd

from moeviz.charts.routing import token_label


def attribution_strip_chart(frame: pd.DataFrame, *, value: str = "ig", title: str | None = None) -> alt.Chart:
    """Token strip (one cell per position, wrapped 32 to a row) coloured by `value` (diverging at 0).

    `frame`: `TokenAttribution.frame()` (pos, token, ig, ig_share, ablation)."""
    data = frame.assign(
        label=[token_label(int(p), str(t)) for p, t in zip(frame["pos"], frame["token"], strict=True)],
        text=frame["token"].astype(str).str.slice(0, 8),
        row=frame["pos"] // 32,
        col=frame["pos"] % 32,
    )
    top = float(data[value].abs().max()) or 1.0
    base = alt.Chart(data, title=title or f"attribution ({value})").encode(
        x=alt.X("col:O", axis=None), y=alt.Y("row:O", axis=None)
    )
    cells = base.mark_rect(stroke="white").encode(
        color=alt.Color(f"{value}:Q", scale=alt.Scale(scheme="redblue", domain=[top, -top]), title=value),
        tooltip=["label:N", alt.Tooltip(f"{value}:Q", format=".4g"), alt.Tooltip("ig_share:Q", format=".1%")],
    )
    return (cells + base.mark_text(fontSize=9).encode(text="text:N")).properties(height=alt.Step(22))


def importance_chart(frame: pd.DataFrame, *, title: str | None = None) -> alt.Chart:
    """Per layer, Δ loss of disabling each expert (bars) with its gate-weighted load in the tooltip.

    `frame`: `moeviz.interventions.expert_importance(...)`."""
    return (
        alt.Chart(frame, title=title or "Δ loss when the expert is disabled")
        .mark_bar()
        .encode(
            x=alt.X("expert:O"),
            y=alt.Y("delta_loss:Q", title="Δ loss (nats)"),
            color=alt.Color("weighted_load:Q", title="gate-weighted load", scale=alt.Scale(scheme="blues")),
            column=alt.Column("layer:O", title="MoE layer"),
            tooltip=[
                "layer",
                "expert",
                alt.Tooltip("delta_loss:Q", format=".4f"),
                alt.Tooltip("load:Q", format=".1%"),
                alt.Tooltip("weighted_load:Q", format=".3f"),
                "tokens",
            ],
        )
        .properties(width=140, height=180)
    )
