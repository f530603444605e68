"""Checkpoint timelines and corpus-store views: checkpoints on x (in training order), one line per MoE layer.

Inputs are the frames of `moeviz.store.checkpoints.CheckpointTimeline` and of `moeviz.store.StoreQuery`;
every function is pure (frame in, `alt.Chart` out) and never re-derives routing.
"""

from __future__ import annotations

import altair as alt
import numpy as np
import pandas as pd

from moeviz.charts._common import FIT_WIDTH, layer_labels, layered_chart, log2_fold, log2_fold_colour
from moeviz.charts.scale import MAX_CATEGORICAL

TIMELINE_INDICATORS = {
    "load_entropy": "normalised load entropy H(f) / log E",
    "max_share": "busiest expert's share of slots",
    "dead_fraction": "share of experts with no token",
    "z_loss": "router z-loss (mean squared logsumexp)",
}
SATURATION_KINDS = {"topk": "saturation_topk", "top1": "saturation_top1"}
LEVEL_COLOURS = {"warning": "#f2a541", "collapsed": "#e4572e"}
CELL = 22  # px a category of the domain specialisation heatmap: room for one 12 px label


def _checkpoint_x(frame: pd.DataFrame) -> alt.X:
    """Checkpoint axis ordered by `order` (training step), not alphabetically."""
    ordered = frame.drop_duplicates("checkpoint").sort_values("order")["checkpoint"].tolist()
    return alt.X("checkpoint:O", title="checkpoint", sort=ordered, axis=alt.Axis(labelAngle=-30))


def _lines(
    data: pd.DataFrame,
    value: str,
    title: str,
    *,
    domain: list[float] | None = None,
    tooltip: list[alt.Tooltip] | None = None,
) -> alt.Chart:
    """One line per layer (`row`) of `value` over the checkpoints; the tooltip defaults to checkpoint, layer
    and the value. Over 20 layers (DeepSeek-V3: 58) the colour is a sequential scale of the layer number,
    not a categorical legend that repeats its colours."""
    y_scale = alt.Scale(domain=domain) if domain else alt.Undefined
    many = data["row"].nunique() > MAX_CATEGORICAL
    color = (
        alt.Color("layer:Q", title="MoE layer", scale=alt.Scale(scheme="viridis"))
        if many
        else alt.Color("row:N", title="MoE layer", sort=alt.EncodingSortField("layer"))
    )
    detail = alt.Detail("row:N") if many else alt.Undefined
    return (
        alt.Chart(data)
        .mark_line(point=True)
        .encode(
            x=_checkpoint_x(data),
            # trimmed labels: a value at 0 at every checkpoint (no dead expert) otherwise reads "0.000000"
            y=alt.Y(f"{value}:Q", title=title, scale=y_scale, axis=alt.Axis(format="~g")),
            color=color,
            detail=detail,
            tooltip=tooltip
            or [
                alt.Tooltip("checkpoint:N"),
                alt.Tooltip("row:N", title="MoE layer"),
                alt.Tooltip(f"{value}:Q", format=".3f", title=title),
            ],
        )
    )


def saturation_timeline_chart(saturation: pd.DataFrame, kind: str = "topk") -> alt.Chart:
    """Router saturation against the final checkpoint per layer: 1 = routes exactly as the final model.

    Input: `CheckpointTimeline.saturation` (columns checkpoint, order, site, layer, saturation_topk,
    saturation_top1). `kind`: "topk" (top-k overlap / k) or "top1" (top-1 agreement). One row per
    (checkpoint, layer) is drawn as one point of that layer's line.
    """
    if kind not in SATURATION_KINDS:
        raise ValueError(f"kind must be one of {sorted(SATURATION_KINDS)}, got {kind!r}")
    column = SATURATION_KINDS[kind]
    data = saturation[["checkpoint", "order", "site", "layer", column]].copy()
    data[column] = data[column].astype(np.float64)
    data["row"] = layer_labels(data)
    label = "top-k overlap with final" if kind == "topk" else "top-1 agreement with final"
    return (
        _lines(data, column, label, domain=[0, 1])
        .properties(
            title=alt.Title(f"Router saturation ({kind})", subtitle="1 = routes as the final checkpoint"),
            height=220,
            autosize=FIT_WIDTH,
        )
        .interactive(bind_y=False)
    )


def balance_timeline_chart(
    collapse: pd.DataFrame, indicator: str = "load_entropy", crossings: pd.DataFrame | None = None
) -> alt.LayerChart:
    """One balance indicator per layer over training, with its collapse thresholds as dashed rules.

    Input: `CheckpointTimeline.collapse` (columns checkpoint, order, site, layer and `indicator`, one of
    TIMELINE_INDICATORS) and optionally `CheckpointTimeline.crossings` (columns indicator, level,
    threshold): one horizontal rule per distinct (level, threshold) of `indicator`, orange = warning,
    red = collapsed; none (and no threshold legend) where `crossings` has none for `indicator`, e.g. the
    z-loss of sigmoid routers, which are not trained with one. Rows: one point per (checkpoint, layer).
    """
    if indicator not in TIMELINE_INDICATORS:
        raise ValueError(f"indicator must be one of {sorted(TIMELINE_INDICATORS)}, got {indicator!r}")
    data = collapse[["checkpoint", "order", "site", "layer", indicator]].copy()
    data[indicator] = data[indicator].astype(np.float64)
    data["row"] = layer_labels(data)
    lines = _lines(data, indicator, indicator)
    rules = pd.DataFrame(columns=["level", "threshold"])
    if crossings is not None and len(crossings):
        sel = crossings[(crossings["indicator"] == indicator) & crossings["threshold"].notna()]
        rules = sel[["level", "threshold"]].drop_duplicates().reset_index(drop=True)
        rules["threshold"] = rules["threshold"].astype(np.float64)
    reference = (
        alt.Chart(rules)
        .mark_rule(strokeDash=[6, 3], strokeWidth=1.5)
        .encode(
            y="threshold:Q",
            color=alt.Color(
                "level:N",
                title="threshold",
                scale=alt.Scale(domain=list(LEVEL_COLOURS), range=list(LEVEL_COLOURS.values())),
                # no rule (a sigmoid router's z-loss has no threshold): no threshold legend either
                legend=alt.Undefined if len(rules) else None,
            ),
            tooltip=[alt.Tooltip("level:N"), alt.Tooltip("threshold:Q", format=".3g")],
        )
    )
    return layered_chart(
        lines,
        reference,
        resolve=alt.Resolve(scale=alt.ScaleResolveMap(color="independent")),
        title=alt.Title(indicator, subtitle=TIMELINE_INDICATORS[indicator]),
        height=220,
        autosize=FIT_WIDTH,
    )


def drift_timeline_chart(drift: pd.DataFrame) -> alt.Chart:
    """Expert drift from the previous checkpoint, mean over each layer's experts (NaN experts skipped).

    Input: `CheckpointTimeline.drift` (columns checkpoint, order, site, layer, expert, drift = 1 − Jaccard
    of the expert's token sets at this and the previous checkpoint). One point per (checkpoint, layer);
    the tooltip adds the largest single-expert drift.
    """
    data = (
        drift.groupby(["checkpoint", "order", "site", "layer"], as_index=False)
        .agg(drift=("drift", "mean"), max_drift=("drift", "max"))
        .sort_values(["order", "site", "layer"], kind="stable")
        .reset_index(drop=True)
    )
    data["row"] = layer_labels(data)
    tooltip = [
        alt.Tooltip("checkpoint:N"),
        alt.Tooltip("row:N", title="MoE layer"),
        alt.Tooltip("drift:Q", format=".3f", title="mean drift"),
        alt.Tooltip("max_drift:Q", format=".3f", title="max drift"),
    ]
    return _lines(data, "drift", "mean drift", domain=[0, 1], tooltip=tooltip).properties(
        title=alt.Title(
            "Expert drift", subtitle="1 − Jaccard of each expert's tokens vs the previous checkpoint"
        ),
        height=220,
        autosize=FIT_WIDTH,
    )


def specialisation_timeline_chart(specialisation: pd.DataFrame) -> alt.FacetChart:
    """Per-domain specialisation over training: lift of each domain's most specialised expert, one line per
    layer, one small panel per domain.

    Input: `CheckpointTimeline.specialisation` (columns checkpoint, order, site, layer, domain, top_expert,
    ds, baseline, lift = max_e DS(e, D) / (k/E)). One point per (checkpoint, layer, domain); 1 = no expert
    prefers the domain more than chance.
    """
    data = specialisation[
        ["checkpoint", "order", "site", "layer", "domain", "top_expert", "ds", "lift"]
    ].copy()
    data["lift"] = data["lift"].astype(np.float64)
    data["row"] = layer_labels(data)
    tooltip = [
        alt.Tooltip("checkpoint:N"),
        alt.Tooltip("domain:N"),
        alt.Tooltip("row:N", title="MoE layer"),
        alt.Tooltip("top_expert:O", title="top expert"),
        alt.Tooltip("ds:Q", format=".3f", title="DS"),
        alt.Tooltip("lift:Q", format=".2f"),
    ]
    line = _lines(data, "lift", "lift of the top expert", tooltip=tooltip)
    return line.properties(width=220, height=160).facet(
        facet=alt.Facet("domain:N", title=None), columns=3, title="Domain specialisation over training"
    )


def domain_specialisation_heatmap(specialisation: pd.DataFrame) -> alt.Chart:
    """Domain × expert heatmap of lift = DS(e, D) / (k/E), one row of panels per layer; white = chance.

    Input: `StoreQuery.domain_specialisation()` (columns site, layer, domain, expert, tokens, dispatched,
    ds, baseline, lift), already filtered to one model and checkpoint. One cell per input row.
    """
    data = specialisation[["site", "layer", "domain", "expert", "tokens", "ds", "lift"]].copy()
    data["log2_lift"] = log2_fold(data["lift"])
    data["row"] = layer_labels(data)
    domains = int(data["domain"].nunique()) if len(data) else 1
    experts = int(data["expert"].nunique())
    # CELL px a column and a row: Streamlit's 12 px labels need that much not to touch (at 16 px a row two
    # domain labels touched and Vega's overlap removal hid one: bible_es); ids of 3 digits stand upright.
    width = max(260, CELL * experts)  # wider than 260 (over 11 experts): one panel a row, to fit the page
    angle = -90 if len(data) and int(data["expert"].max()) >= 100 else 0
    return (
        alt.Chart(data)
        .mark_rect(stroke="white", strokeWidth=0.5)
        .encode(
            x=alt.X("expert:O", axis=alt.Axis(labelAngle=angle, labelOverlap=False)),
            y=alt.Y("domain:N", title=None, axis=alt.Axis(labelOverlap=False, labelLimit=0)),
            color=log2_fold_colour("log2_lift", "log₂ lift"),
            tooltip=[
                alt.Tooltip("row:N", title="MoE layer"),
                alt.Tooltip("domain:N"),
                alt.Tooltip("expert:O"),
                alt.Tooltip("tokens:Q"),
                alt.Tooltip("ds:Q", format=".3f", title="DS"),
                alt.Tooltip("lift:Q", format=".2f"),
            ],
        )
        .properties(width=width, height=CELL * domains)
        .facet(
            facet=alt.Facet("row:N", title="MoE layer", sort=alt.EncodingSortField("layer")),
            columns=2 if width <= 260 else 1,
        )
        .properties(title="Domain specialisation (lift over chance)")
    )
