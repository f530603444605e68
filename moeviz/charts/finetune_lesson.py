"""The Learn page's fine-tuning step: one small curve per indicator (new-domain loss, old-domain loss, router
mismatch, max share) with a line per fine-tuning mode, from the shipped run of
`scripts/samples/finetune_modes.py`. Frames in, `alt.Chart` out; the modes' colours are fixed here so that a
page can draw one colour key for several panels (each panel has no legend of its own, to fit a 1280 × 720
projector)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import altair as alt
import pandas as pd

from moeviz.charts._common import FIT_WIDTH, INK, layered_chart
from moeviz.charts.lab import FINETUNE_TITLES, RUN_COLOURS

LESSON_METRICS = ("new_loss", "old_loss", "router_mismatch", "max_share")
PERCENT_METRICS = ("router_mismatch", "max_share")  # shares: drawn as percentages


def mode_colours(runs: Sequence[str]) -> dict[str, str]:
    """{run label: colour} in the order given (the Lab's run colours)."""
    return {run: RUN_COLOURS[i % len(RUN_COLOURS)] for i, run in enumerate(runs)}


def finetune_lesson_chart(
    curves: pd.DataFrame,
    metric: str,
    *,
    runs: Sequence[str],
    height: int = 90,
    reference: float | None = None,
) -> alt.LayerChart:
    """One indicator over the training steps (x, unlabelled), a line per run (mode) coloured by
    `mode_colours(runs)`, no legend; `reference`: a dashed rule (the even share 1/E on max share).

    Input: one row per (run, step): columns run, step and `metric` (NaN rows are left out: steps without an
    evaluation)."""
    if metric not in LESSON_METRICS:
        raise ValueError(f"unknown lesson metric {metric!r}; known: {', '.join(LESSON_METRICS)}")
    title, subtitle = FINETUNE_TITLES[metric]
    data = (
        curves[["run", "step", metric]]
        .rename(columns={metric: "value"})
        .dropna(subset=["value"])
        .astype({"value": float, "step": int})
        .reset_index(drop=True)
    )
    colours = mode_colours(runs)
    fmt = ".0%" if metric in PERCENT_METRICS else ".2f"
    line = (
        alt.Chart()
        .mark_line(strokeWidth=2)
        .encode(
            x=alt.X("step:Q", title=None, axis=alt.Axis(tickMinStep=1, format="d", tickCount=4)),
            y=alt.Y(
                "value:Q",
                title=None,
                scale=alt.Scale(zero=metric == "router_mismatch"),
                axis=alt.Axis(format=fmt, tickCount=3),
            ),
            color=alt.Color(
                "run:N", scale=alt.Scale(domain=list(colours), range=list(colours.values())), legend=None
            ),
            detail="run:N",
            tooltip=[
                alt.Tooltip("run:N", title="mode"),
                alt.Tooltip("step:Q"),
                alt.Tooltip("value:Q", format=".3~f", title=title.lower()),
            ],
        )
    )
    layers: list[alt.Chart] = [line]
    if reference is not None and math.isfinite(reference):
        layers.append(
            # one mark from the chart's own data (its first row), so the chart keeps one dataset
            alt.Chart()
            .transform_window(_row="row_number()")
            .transform_filter("datum._row == 1")
            .mark_rule(color=INK, strokeDash=[4, 3], opacity=0.6)
            .encode(y=alt.YDatum(float(reference)), tooltip=alt.value(f"even share 1/E: {reference:.3f}"))
        )
    return layered_chart(
        *layers, data=data, title=alt.Title(title, subtitle=subtitle), autosize=FIT_WIDTH, height=height
    )
