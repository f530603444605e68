"""The Lab's curves: a small MoE trained live (`moeviz.lab`), one function per view, each a function of the
run's frames (`LabRun.history()`, `LabRun.load_history()`). Every view can mark the step where the collapse
verdict first tripped (`collapse_step`) with a red dashed rule, and can fix its step axis to the run's
length (`steps`) so that a curve visibly grows from left to right while the model trains."""

from __future__ import annotations

import math

import altair as alt
import numpy as np
import pandas as pd

from moeviz.analysis.losses import AUX_LOSS_FORMS
from moeviz.charts._common import FIT_WIDTH, INK, PAPER
from moeviz.charts.scale import MAX_CATEGORICAL, add_expert_colour_fields, expert_colour

COLLAPSE_COLOUR = "#d62728"  # the collapse rule: readable on the light and the dark page
LOSS_COLOURS = {"train": "#4c78a8", "held-out": "#f58518"}
MAX_LOAD_STEPS = 200  # steps drawn in the stacked load area (thinned evenly beyond)


def _step_x(steps: int | None) -> alt.X:
    scale = alt.Scale(domain=[0, int(steps)], nice=False) if steps else alt.Undefined
    return alt.X("step:Q", title="training step", scale=scale, axis=alt.Axis(tickMinStep=1))


def _one_mark() -> alt.Chart:
    """A layer that draws one mark from the chart's own data (its first row): the rules below are set by
    `alt.datum`, so each chart keeps one dataset, its frame."""
    return alt.Chart().transform_window(_row="row_number()").transform_filter("datum._row == 1")


def _collapse_marks(collapse_step: int | None, *, short: bool = False) -> list[alt.Chart]:
    """A red dashed vertical rule at `collapse_step` with its label, "collapse (step N)" or, on a small
    chart, "collapse" (none when the verdict never tripped)."""
    if collapse_step is None:
        return []
    step = int(collapse_step)
    text = "collapse" if short else f"collapse (step {step})"
    rule = _one_mark().mark_rule(color=COLLAPSE_COLOUR, strokeDash=[6, 3], strokeWidth=2)
    label = _one_mark().mark_text(
        color=COLLAPSE_COLOUR, align="left", baseline="top", dx=4, dy=2, fontWeight="bold"
    )
    tooltip = alt.value(f"the collapse verdict first tripped at step {step}")
    return [
        rule.encode(x=alt.datum(step), tooltip=tooltip),
        label.encode(x=alt.datum(step), y=alt.value(0), text=alt.datum(text), tooltip=tooltip),
    ]


def lab_loss_chart(
    history: pd.DataFrame,
    *,
    steps: int | None = None,
    collapse_step: int | None = None,
    title: str = "Loss",
) -> alt.LayerChart:
    """Train loss at every step and held-out loss at each evaluation (dots), in nats per token.

    Input: `LabRun.history()` (columns step, train_loss, heldout_loss (NaN between evaluations), …); the
    chart's one dataset is that frame, unchanged."""
    x = _step_x(steps)
    colour = alt.Color(
        "series:N",
        scale=alt.Scale(domain=list(LOSS_COLOURS), range=list(LOSS_COLOURS.values())),
        legend=alt.Legend(title=None, orient="top-right"),
    )
    y_title = "loss (nats / token)"
    train = (
        alt.Chart()
        .transform_filter("isValid(datum.train_loss)")
        .transform_calculate(series="'train'")
        .mark_line(strokeWidth=1.5)
        .encode(
            x=x,
            y=alt.Y("train_loss:Q", title=y_title, scale=alt.Scale(zero=False)),
            color=colour,
            tooltip=[alt.Tooltip("step:Q"), alt.Tooltip("train_loss:Q", format=".3f", title="train loss")],
        )
    )
    heldout = (
        alt.Chart()
        .transform_filter("isValid(datum.heldout_loss)")
        .transform_calculate(series="'held-out'")
        .mark_line(strokeWidth=2, point=alt.OverlayMarkDef(size=40, filled=True))
        .encode(
            x=x,
            y=alt.Y("heldout_loss:Q", title=y_title),
            color=colour,
            tooltip=[
                alt.Tooltip("step:Q"),
                alt.Tooltip("heldout_loss:Q", format=".3f", title="held-out loss"),
            ],
        )
    )
    return alt.layer(train, heldout, *_collapse_marks(collapse_step), data=history).properties(
        title=alt.Title(title, subtitle="line: train · dots: held-out evaluations"),
        height=200,
        autosize=FIT_WIDTH,
    )


def thin_steps(frame: pd.DataFrame, max_steps: int = MAX_LOAD_STEPS) -> pd.DataFrame:
    """The rows of at most `max_steps` evenly spaced steps of `frame` (its first and last step kept), so a
    long run's per-expert curves stay light to draw."""
    steps = np.unique(frame["step"].to_numpy())
    if len(steps) <= max_steps:
        return frame
    keep = steps[np.unique(np.linspace(0, len(steps) - 1, max_steps).round().astype(int))]
    return frame[frame["step"].isin(keep)]


def lab_load_chart(
    load: pd.DataFrame,
    layer: int,
    num_experts: int,
    *,
    steps: int | None = None,
    collapse_step: int | None = None,
) -> alt.LayerChart:
    """Stacked area of one layer's per-expert load over the training steps: each band an expert's share of
    the step's slots (an even router gives bands of 1/E each; a collapsed one, one band filling the chart).

    Input: `LabRun.load_history()` (columns step, layer, expert, load); only `layer` is drawn, and at most
    MAX_LOAD_STEPS steps (`thin_steps`)."""
    data = thin_steps(load[load["layer"] == layer])[["step", "expert", "load"]].copy()
    add_expert_colour_fields(data, num_experts)
    colour = expert_colour(num_experts)
    if num_experts <= MAX_CATEGORICAL:  # a half-width chart: the legend in rows of 4 or 5, not one long row
        colour["legend"] = alt.Legend(
            title="expert", orient="bottom", direction="horizontal", columns=4 if num_experts <= 8 else 5
        )
    area = (
        alt.Chart()
        .mark_area(opacity=0.9, line=alt.OverlayMarkDef(strokeWidth=0.4, color=PAPER, opacity=0.6))
        .encode(
            x=_step_x(steps),
            y=alt.Y(
                "load:Q",
                stack="zero",
                title="share of the step's slots",
                axis=alt.Axis(format="%"),
                scale=alt.Scale(domain=[0, 1], nice=False),
            ),
            color=colour,
            detail="expert:N",
            order=alt.Order("expert:Q"),
            tooltip=[
                alt.Tooltip("step:Q"),
                alt.Tooltip("expert:N"),
                alt.Tooltip("load:Q", format=".1%", title="share of slots"),
            ],
        )
    )
    fair = f"even: 1/{num_experts} each" if num_experts > 1 else "one expert"
    legend = "" if num_experts <= MAX_CATEGORICAL else " · colour = expert id"
    return alt.layer(area, *_collapse_marks(collapse_step), data=data).properties(
        title=alt.Title(f"Expert load, layer {layer}", subtitle=f"a band per expert · {fair}{legend}"),
        height=200,
        autosize=FIT_WIDTH,
    )


# The per-step indicators of `LabRun.history()` the Lab draws as small curves: column -> (title, subtitle).
# An auxiliary loss's subtitle is its balanced value, read from the one table of forms (AUX_LOSS_FORMS).
LAB_METRICS = {
    "load_entropy": ("Load entropy", "normalised, 1 = even · dashed = even"),
    "dead_experts_window_sum": ("Dead experts", "recent steps, all layers"),
    "z_loss": ("Router z-loss", "mean logsumexp²"),
    "aux_loss_megatron": ("Balancing loss, Megatron form", None),
}
COUNT_METRICS = {"dead_experts_window_sum"}  # whole numbers: drawn as steps, integer ticks


def lab_metric_title(metric: str) -> tuple[str, str]:
    """(title, subtitle) of a LAB_METRICS curve; an aux loss's subtitle says its balanced value, from
    AUX_LOSS_FORMS."""
    if metric not in LAB_METRICS:
        raise ValueError(f"unknown lab metric {metric!r}; known: {sorted(LAB_METRICS)}")
    title, subtitle = LAB_METRICS[metric]
    if metric in AUX_LOSS_FORMS:
        subtitle = f"{AUX_LOSS_FORMS[metric].balanced} = even load"
    return title, subtitle


def lab_metric_chart(
    history: pd.DataFrame,
    metric: str,
    *,
    steps: int | None = None,
    collapse_step: int | None = None,
    reference: float | None = None,
) -> alt.LayerChart:
    """One per-step indicator of the run (a column of LAB_METRICS) as a line, with an optional dashed
    reference level (e.g. the normalised load entropy of an even load, 1).

    Input: `LabRun.history()`; the chart's one dataset is that frame, unchanged."""
    title, subtitle = lab_metric_title(metric)
    line = (
        alt.Chart()
        .transform_filter(f"isValid(datum.{metric})")
        .mark_line(
            color="#54a24b",
            strokeWidth=1.8,
            interpolate="step-after" if metric in COUNT_METRICS else "linear",
        )
        .encode(
            x=_step_x(steps),
            y=alt.Y(
                f"{metric}:Q",
                title=None,
                axis=alt.Axis(tickMinStep=1) if metric in COUNT_METRICS else alt.Undefined,
            ),
            tooltip=[alt.Tooltip("step:Q"), alt.Tooltip(f"{metric}:Q", format=".3~f", title=title.lower())],
        )
    )
    layers = [line]
    if reference is not None and math.isfinite(reference):
        layers.append(
            _one_mark()
            .mark_rule(color=INK, strokeDash=[4, 3], opacity=0.6)
            .encode(y=alt.datum(float(reference)), tooltip=alt.value(f"even load: {reference:.3f}"))
        )
    return alt.layer(*layers, *_collapse_marks(collapse_step, short=True), data=history).properties(
        title=alt.Title(title, subtitle=subtitle), height=130, autosize=FIT_WIDTH
    )
