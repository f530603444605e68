"""Attribution views: a token strip coloured by attribution, and expert importance beside load."""

from __future__ import annotations

import altair as alt
import pandas as pd

from moeviz.charts._common import layered_chart
from moeviz.charts.routing import token_label


def attribution_strip_chart(
    frame: pd.DataFrame, *, value: str = "ig", title: str | None = None
) -> alt.LayerChart:
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
    return layered_chart(
        cells, base.mark_text(fontSize=9).encode(text=alt.Text("text:N")), height=alt.Step(22)
    )


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


def position_delta_chart(frame: pd.DataFrame, *, title: str | None = None) -> alt.LayerChart:
    """Δ log-prob of the actual next token at each position (bars; orange where the token's routing
    changed at some MoE layer), the intervened position(s) marked by a dashed rule.

    `frame`: `Counterfactual.position_frame()` (pos, token, next_token, delta, intervened, routing_changed,
    ...). Positions where every token is intervened on get no rule (the subtitle says so)."""
    data = frame.assign(
        label=[token_label(int(p), str(t)) for p, t in zip(frame["pos"], frame["token"], strict=True)],
        routing=frame["routing_changed"].map({True: "changed", False: "same"}),
    )
    marked = data[data["intervened"]]
    every = len(data) > 0 and len(marked) == len(data)
    size = max(1, min(14, 640 // max(len(data), 1) - 1))
    x = alt.X("pos:Q", title="position t (Δ log p of token t+1)", scale=alt.Scale(nice=False, padding=8))
    bars = (
        alt.Chart(data)
        .mark_bar(size=size)
        .encode(
            x=x,
            y=alt.Y("delta:Q", title="Δ log p (nats)"),
            color=alt.Color(
                "routing:N",
                scale=alt.Scale(domain=["same", "changed"], range=["#4c78a8", "#f58518"]),
                title="routing at t",
            ),
            tooltip=[
                "label:N",
                alt.Tooltip("next_token:N", title="next token"),
                alt.Tooltip("logprob_before:Q", format=".4f"),
                alt.Tooltip("logprob_after:Q", format=".4f"),
                alt.Tooltip("delta:Q", format="+.4f"),
                "routing:N",
            ],
        )
    )
    zero = alt.Chart(pd.DataFrame({"y": [0.0]})).mark_rule(color="grey").encode(y="y:Q")
    layers = [zero, bars]
    if len(marked) and not every:
        rules = (
            alt.Chart(marked.assign(what="intervened"))
            .mark_rule(color="#d62728", strokeDash=[4, 3], strokeWidth=1.5)
            .encode(x=x, tooltip=["label:N", "what:N"])
        )
        layers.append(rules)
    subtitle = (
        "intervened at every position" if every else "dashed: the intervened position" if len(marked) else ""
    )
    return layered_chart(
        *layers,
        title=alt.Title(title or "Effect on every next-token prediction", subtitle=subtitle),
        height=220,
        width="container",
    )
