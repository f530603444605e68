"""The Lab's curves: a small MoE trained live (`moeviz.lab`), one function per view, each a function of the
run's frames (`LabRun.history()`, `LabRun.load_history()`). Every view can mark the step where the collapse
verdict first tripped (`collapse_step`) with a red dashed rule, and can fix its step axis to the run's
length (`steps`) so that a curve visibly grows from left to right while the model trains."""

from __future__ import annotations

import math
from typing import Literal

import altair as alt
import numpy as np
import pandas as pd

from moeviz.analysis.losses import AUX_LOSS_FORMS
from moeviz.charts._common import FIT_WIDTH, INK, PAPER, layered_chart
from moeviz.charts.scale import MAX_CATEGORICAL, add_expert_colour_fields, expert_colour

COLLAPSE_COLOUR = "#d62728"  # the collapse rule: readable on the light and the dark page
LOSS_COLOURS = {"train": "#4c78a8", "held-out": "#f58518"}
MAX_LOAD_STEPS = 200  # steps drawn in the stacked load area (thinned evenly beyond)
RAW_OPACITY = 0.3  # the raw curve behind its smoothed one, as TensorBoard draws it
SCRUB_COLOUR = "#7f7f7f"  # the load snapshot's step on the stacked load area
# a colour per run (Tableau 10, its blue first as the single-run charts): set here, not left to the theme,
# whose default scheme for a few categories is shades of one blue
RUN_COLOURS = [
    "#4c78a8",
    "#f58518",
    "#54a24b",
    "#e45756",
    "#72b7b2",
    "#b279a2",
    "#eeca3b",
    "#9d755d",
    "#ff9da6",
    "#bab0ac",
]


def _step_x(steps: int | None) -> alt.X:
    scale = alt.Scale(domain=[0, int(steps)], nice=False) if steps else alt.Undefined
    return alt.X("step:Q", title="training step", scale=scale, axis=alt.Axis(tickMinStep=1))


def _smoothed(frame: pd.DataFrame, column: str) -> str | None:
    """The frame's column of `column` smoothed (`moeviz.lab.curves.with_smoothed` adds it), if any."""
    name = f"{column}_smoothed"
    return name if name in frame.columns else None


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
        rule.encode(x=alt.XDatum(step), tooltip=tooltip),
        label.encode(x=alt.XDatum(step), y=alt.value(0), text=alt.TextDatum(text), tooltip=tooltip),
    ]


def lab_loss_chart(
    history: pd.DataFrame,
    *,
    steps: int | None = None,
    collapse_step: int | None = None,
    title: str = "Loss",
) -> alt.LayerChart:
    """Train loss at every step and held-out loss at each evaluation (dots), in nats per token; when the
    frame has train_loss_smoothed (`moeviz.lab.curves.with_smoothed`) the train loss is drawn smoothed over
    its faint raw curve, as TensorBoard does.

    Input: `LabRun.history()` (columns step, train_loss, heldout_loss (NaN between evaluations), …); the
    chart's one dataset is that frame, unchanged."""
    x = _step_x(steps)
    smoothed = _smoothed(history, "train_loss")
    colour = alt.Color(
        "series:N",
        scale=alt.Scale(domain=list(LOSS_COLOURS), range=list(LOSS_COLOURS.values())),
        # below the plot: a legend inside it sat on the curves (the loss starts in the top corners)
        legend=alt.Legend(title=None, orient="bottom", direction="horizontal"),
    )
    y_title = "loss (nats / token)"
    train = (
        alt.Chart()
        .transform_filter("isValid(datum.train_loss)")
        .transform_calculate(series="'train'")
        .mark_line(strokeWidth=1.5, opacity=RAW_OPACITY if smoothed else 1.0)
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
    layers = [train, heldout]
    if smoothed:
        layers.insert(
            1,
            train.mark_line(strokeWidth=2).encode(
                y=alt.Y(f"{smoothed}:Q", title=y_title, scale=alt.Scale(zero=False)),
                tooltip=[
                    alt.Tooltip("step:Q"),
                    alt.Tooltip("train_loss:Q", format=".3f", title="train loss"),
                    alt.Tooltip(f"{smoothed}:Q", format=".3f", title="smoothed"),
                ],
            ),
        )
    subtitle = "line: train · dots: held-out evaluations" + (" · faint: raw train" if smoothed else "")
    return layered_chart(
        *layers,
        *_collapse_marks(collapse_step),
        data=history,
        title=alt.Title(title, subtitle=subtitle),
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
    marked_step: int | None = None,
) -> alt.LayerChart:
    """Stacked area of one layer's per-expert load over the training steps: each band an expert's share of
    the step's slots (an even router gives bands of 1/E each; a collapsed one, one band filling the chart).
    `marked_step`: a grey rule at the step of the load snapshot (`lab_load_snapshot_chart`).

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
    marks = [area, *_collapse_marks(collapse_step)]
    if marked_step is not None:
        marks.append(
            _one_mark()
            .mark_rule(color=SCRUB_COLOUR, strokeWidth=2)
            .encode(x=alt.XDatum(int(marked_step)), tooltip=alt.value(f"load snapshot: step {marked_step}"))
        )
    return layered_chart(
        *marks,
        data=data,
        title=alt.Title(f"Expert load, layer {layer}", subtitle=f"a band per expert · {fair}{legend}"),
        height=200,
        autosize=FIT_WIDTH,
    )


# The per-step indicators of `LabRun.history()` the Lab draws as small curves: column -> (title, subtitle).
# An auxiliary loss's subtitle (None here) is its balanced value, read from the one table of forms
# (AUX_LOSS_FORMS).
LAB_METRICS: dict[str, tuple[str, str | None]] = {
    "load_entropy": ("Load entropy", "normalised · dashed: even"),
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
    if subtitle is None:
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
    reference level (e.g. the normalised load entropy of an even load, 1); when the frame has
    `<metric>_smoothed` (`moeviz.lab.curves.with_smoothed`), that line over the faint raw one.

    Input: `LabRun.history()`; the chart's one dataset is that frame, unchanged."""
    title, subtitle = lab_metric_title(metric)
    smoothed = _smoothed(history, metric)
    line = (
        alt.Chart()
        .transform_filter(f"isValid(datum.{metric})")
        .mark_line(
            color="#54a24b",
            strokeWidth=1.8,
            interpolate="step-after" if metric in COUNT_METRICS else "linear",
            opacity=RAW_OPACITY if smoothed else 1.0,
        )
        .encode(
            x=_step_x(steps),
            y=alt.Y(
                f"{metric}:Q",
                title=None,
                # whole-number labels: an all-zero count (no dead expert) otherwise reads "0.000000"
                axis=alt.Axis(tickMinStep=1, format="d") if metric in COUNT_METRICS else alt.Undefined,
            ),
            tooltip=[alt.Tooltip("step:Q"), alt.Tooltip(f"{metric}:Q", format=".3~f", title=title.lower())],
        )
    )
    layers = [line]
    if smoothed:
        layers.append(
            line.mark_line(color="#54a24b", strokeWidth=2).encode(
                y=alt.Y(f"{smoothed}:Q", title=None),
                tooltip=[
                    alt.Tooltip("step:Q"),
                    alt.Tooltip(f"{metric}:Q", format=".3~f", title=title.lower()),
                    alt.Tooltip(f"{smoothed}:Q", format=".3~f", title="smoothed"),
                ],
            )
        )
    if reference is not None and math.isfinite(reference):
        layers.append(
            _one_mark()
            .mark_rule(color=INK, strokeDash=[4, 3], opacity=0.6)
            .encode(y=alt.YDatum(float(reference)), tooltip=alt.value(f"even load: {reference:.3f}"))
        )
    return layered_chart(
        *layers,
        *_collapse_marks(collapse_step, short=True),
        data=history,
        title=alt.Title(title, subtitle=subtitle),
        height=130,
        autosize=FIT_WIDTH,
    )


def lab_load_snapshot_chart(load: pd.DataFrame, layer: int, step: int, num_experts: int) -> alt.LayerChart:
    """One layer's load at one training step: a bar per expert (its share of the step's slots), with the
    even share 1/E dashed; the step scrubber's view of `lab_load_chart`.

    Input: `LabRun.load_history()`; the chart's one dataset is the rows of (`step`, `layer`)."""
    data = load[(load["layer"] == layer) & (load["step"] == step)][["step", "expert", "load"]].copy()
    add_expert_colour_fields(data, num_experts)
    colour = expert_colour(num_experts)
    colour["legend"] = None  # the bars' own axis names the experts
    bars = (
        alt.Chart()
        .mark_bar()
        .encode(
            x=alt.X("expert:O", title="expert", axis=alt.Axis(labelAngle=0)),
            y=alt.Y("load:Q", title="share", axis=alt.Axis(format="%")),
            color=colour,
            tooltip=[
                alt.Tooltip("expert:N"),
                alt.Tooltip("load:Q", format=".1%", title="share of slots"),
            ],
        )
    )
    marks = [bars]
    if num_experts > 1:
        even = 1.0 / num_experts
        marks.append(
            _one_mark()
            .mark_rule(color=INK, strokeDash=[4, 3], opacity=0.6)
            .encode(y=alt.YDatum(even), tooltip=alt.value(f"even share: 1/{num_experts}"))
        )
    return layered_chart(
        *marks,
        data=data,
        title=alt.Title(f"Load at step {step}, layer {layer}", subtitle="bars: experts · dashed: even"),
        height=130,
        autosize=FIT_WIDTH,
    )


# Titles of the curves a runs view overlays (`moeviz.lab.curves.CURVE_METRICS`): the two losses, then
# LAB_METRICS' own titles.
RUN_TITLES = {"train_loss": "Train loss", "heldout_loss": "Held-out loss"}


def lab_runs_title(metric: str) -> str:
    """Title of a runs-view curve."""
    return RUN_TITLES[metric] if metric in RUN_TITLES else lab_metric_title(metric)[0]


def lab_runs_chart(
    curves: pd.DataFrame,
    metric: str,
    *,
    runs: list[str] | None = None,
    steps: int | None = None,
    smoothed: bool = False,
    reference: float | None = None,
) -> alt.LayerChart:
    """Several runs' `metric` on shared axes, a colour per run (TensorBoard's runs view): the raw curve, or,
    with `smoothed`, the smoothed curve over its faint raw one.

    Input: `moeviz.lab.curves.runs_curves` (run, metric, step, value, smoothed); the chart's one dataset is
    that frame's rows of `metric`. `runs`: the colour order (default: the frame's order of appearance)."""
    data = curves[curves["metric"] == metric].reset_index(drop=True)
    order = runs if runs is not None else list(dict.fromkeys(curves["run"]))
    title = lab_runs_title(metric)
    colour = alt.Color(
        "run:N",
        scale=alt.Scale(domain=order, range=[RUN_COLOURS[i % len(RUN_COLOURS)] for i in range(len(order))]),
        # two a row: a half-width chart at 900 px has room for two names; full-strength swatches (not the raw
        # curve's faint ones)
        legend=alt.Legend(title=None, orient="bottom", direction="horizontal", columns=2, symbolOpacity=1),
    )
    interpolate: Literal["step-after", "linear"] = "step-after" if metric in COUNT_METRICS else "linear"
    axis = alt.Axis(tickMinStep=1, format="d") if metric in COUNT_METRICS else alt.Undefined
    tooltip = [
        alt.Tooltip("run:N"),
        alt.Tooltip("step:Q"),
        alt.Tooltip("value:Q", format=".3~f", title=title.lower()),
    ]
    point = alt.OverlayMarkDef(size=20, filled=True) if metric == "heldout_loss" else False
    raw = (
        alt.Chart()
        .mark_line(
            strokeWidth=1.5, interpolate=interpolate, opacity=RAW_OPACITY if smoothed else 1.0, point=point
        )
        .encode(
            x=_step_x(steps),
            y=alt.Y("value:Q", title=None, scale=alt.Scale(zero=False), axis=axis),
            color=colour,
            detail="run:N",
            tooltip=tooltip,
        )
    )
    layers = [raw]
    if smoothed:
        layers.append(
            raw.mark_line(strokeWidth=2, interpolate=interpolate).encode(
                y=alt.Y("smoothed:Q", title=None, scale=alt.Scale(zero=False), axis=axis),
                tooltip=[*tooltip, alt.Tooltip("smoothed:Q", format=".3~f", title="smoothed")],
            )
        )
    if reference is not None and math.isfinite(reference):
        layers.append(
            _one_mark()
            .mark_rule(color=INK, strokeDash=[4, 3], opacity=0.6)
            .encode(y=alt.YDatum(float(reference)), tooltip=alt.value(f"even load: {reference:.3f}"))
        )
    subtitle = "smoothed · faint: raw" if smoothed else "a colour per run"
    return layered_chart(
        *layers, data=data, title=alt.Title(title, subtitle=subtitle), height=150, autosize=FIT_WIDTH
    )


# Titles and subtitles of the fine-tune curves (`moeviz.lab.finetune.CURVE_METRICS`).
FINETUNE_TITLES = {
    "new_loss": ("New-domain loss", "held out: lower = adapted"),
    "old_loss": ("Old-domain loss", "held out: higher = forgot"),
    "router_mismatch": ("Router mismatch", "top-k sets changed vs the start model"),
    "max_share": ("Max share", "busiest expert's share of the slots, worst layer"),
    "aux_loss_megatron": ("Aux loss", "Megatron form: 1 = even load"),
    "train_loss": ("Train loss", "new domain, each step"),
}


def lab_finetune_chart(
    curves: pd.DataFrame,
    metric: str,
    *,
    runs: list[str] | None = None,
    steps: int | None = None,
    reference: float | None = None,
) -> alt.LayerChart:
    """One fine-tune curve of several runs (one per mode) on shared axes, a colour per run, a point at each
    evaluation (step 0 = the start model); `reference`: a dashed rule (the even share 1/E on max share).

    Input: `moeviz.lab.curves.runs_curves` of the runs' `FinetuneRun.history()` frames (run, metric, step,
    value, smoothed); the chart's one dataset is that frame's rows of `metric`. `runs`: the colour order."""
    if metric not in FINETUNE_TITLES:
        raise ValueError(f"unknown fine-tune metric {metric!r}; known: {sorted(FINETUNE_TITLES)}")
    title, subtitle = FINETUNE_TITLES[metric]
    data = curves[curves["metric"] == metric].reset_index(drop=True)
    order = runs if runs is not None else list(dict.fromkeys(curves["run"]))
    colour = alt.Color(
        "run:N",
        scale=alt.Scale(domain=order, range=[RUN_COLOURS[i % len(RUN_COLOURS)] for i in range(len(order))]),
        legend=alt.Legend(title=None, orient="bottom", direction="horizontal", columns=2, symbolOpacity=1),
    )
    evaluated = metric not in ("train_loss", "aux_loss_megatron")
    line = (
        alt.Chart()
        .mark_line(strokeWidth=1.8, point=alt.OverlayMarkDef(size=22, filled=True) if evaluated else False)
        .encode(
            x=_step_x(steps),
            y=alt.Y("value:Q", title=None, scale=alt.Scale(zero=metric == "router_mismatch")),
            color=colour,
            detail="run:N",
            tooltip=[
                alt.Tooltip("run:N"),
                alt.Tooltip("step:Q"),
                alt.Tooltip("value:Q", format=".3~f", title=title.lower()),
            ],
        )
    )
    layers = [line]
    if reference is not None and math.isfinite(reference):
        layers.append(
            _one_mark()
            .mark_rule(color=INK, strokeDash=[4, 3], opacity=0.6)
            .encode(y=alt.YDatum(float(reference)), tooltip=alt.value(f"even share: {reference:.3f}"))
        )
    return layered_chart(
        *layers, data=data, title=alt.Title(title, subtitle=subtitle), height=150, autosize=FIT_WIDTH
    )
