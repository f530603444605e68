"""Structure views: co-activation, cross-layer transitions, consecutive-token repetition, expert paths."""

from __future__ import annotations

import altair as alt
import numpy as np
import pandas as pd

from moeviz.charts._common import FIT_WIDTH, layer_band_axis

CELL = 22  # px a category (expert, path): Streamlit's 12 px labels need that much not to touch
PANEL_ROW = 760  # px of transition panels side by side; more and they wrap to the next row


def _expert_axis(frame: pd.DataFrame, column: str, **kwargs) -> alt.Axis:
    """An expert axis that keeps every label: upright ids of 3 digits and more (they would touch)."""
    wide = len(frame) and int(frame[column].max()) >= 100
    return alt.Axis(labelAngle=-90 if wide else 0, labelOverlap=False, **kwargs)


def coactivation_heatmap(coactivation: pd.DataFrame, *, title: str | None = None) -> alt.Chart:
    """Expert × co-expert heatmap of P(co_expert ∈ S_t | expert ∈ S_t) for one layer.

    Input: the rows of `moeviz.analysis.coactivation_frame(trace, adjacent_only)` for one (layer, site):
    columns expert, co_expert, pair_count, expert_count, coactivation (NaN for an unused expert, drawn
    grey), variant. The subtitle names the variant (all pairs, or rank-adjacent pairs only).
    """
    data = coactivation[["expert", "co_expert", "pair_count", "expert_count", "coactivation"]].copy()
    data = data[data["expert"] != data["co_expert"]].reset_index(drop=True)
    variants = set(coactivation["variant"]) if "variant" in coactivation else {"all_pairs"}
    subtitle = (
        "rank-adjacent pairs only (ranks r, r+1)" if variants == {"rank_adjacent"} else "all pairs of S_t"
    )
    experts = int(coactivation["expert"].nunique()) if len(coactivation) else 1
    return (
        alt.Chart(data)
        .mark_rect()
        .encode(
            x=alt.X("co_expert:O", title="co-expert j", axis=_expert_axis(data, "co_expert")),
            y=alt.Y("expert:O", title="given expert i", axis=alt.Axis(labelOverlap=False)),
            color=alt.Color(
                "coactivation:Q", scale=alt.Scale(scheme="greens", domain=[0, 1]), title="P(j | i)"
            ),
            tooltip=[
                alt.Tooltip("expert:O", title="i"),
                alt.Tooltip("co_expert:O", title="j"),
                alt.Tooltip("coactivation:Q", format=".3f", title="P(j ∈ S | i ∈ S)"),
                alt.Tooltip("pair_count:Q", title="tokens with both"),
                alt.Tooltip("expert_count:Q", title="tokens with i"),
            ],
        )
        .properties(
            title=alt.Title(title or "Co-activation", subtitle=subtitle),
            height=max(CELL * experts, 140),
            autosize=FIT_WIDTH,
        )
    )


def transition_heatmaps(transitions: pd.DataFrame, *, title: str | None = None) -> alt.FacetChart:
    """One heatmap per consecutive layer pair: P(next_expert at layer+1 | expert at layer).

    Input: `moeviz.analysis.transition_frame(trace, top1)` (columns site, layer, next_layer, expert,
    next_expert, count, expert_count, probability, variant). Faceted by "layer → next_layer".
    """
    data = transitions[
        ["site", "layer", "next_layer", "expert", "next_expert", "count", "probability"]
    ].copy()
    data["pair"] = [f"{a} → {b}" for a, b in zip(data["layer"], data["next_layer"], strict=True)]
    data["probability"] = data["probability"].astype(np.float64)
    experts = int(max(data["expert"].nunique(), data["next_expert"].nunique())) if len(data) else 1
    # CELL px an expert (at 16 px, capped at 320, Vega hid every other label); as many panels a row as fit.
    side = max(CELL * experts, 120)
    top1 = "variant" in transitions and set(transitions["variant"]) == {"top1"}
    return (
        alt.Chart(data)
        .mark_rect()
        .encode(
            x=alt.X("next_expert:O", title="expert at next layer", axis=_expert_axis(data, "next_expert")),
            y=alt.Y("expert:O", title="expert", axis=alt.Axis(labelOverlap=False)),
            color=alt.Color("probability:Q", scale=alt.Scale(scheme="oranges", zero=True), title="P"),
            tooltip=[
                alt.Tooltip("pair:N", title="layers"),
                alt.Tooltip("expert:O"),
                alt.Tooltip("next_expert:O"),
                alt.Tooltip("probability:Q", format=".3f"),
                alt.Tooltip("count:Q", title="tokens"),
            ],
        )
        .properties(width=side, height=side)
        .facet(
            facet=alt.Facet("pair:N", title=None, sort=alt.EncodingSortField("layer")),
            columns=max(1, min(3, PANEL_ROW // (side + 60))),
        )
        .properties(
            title=alt.Title(
                title or "Cross-layer transitions",
                subtitle="top-1 → top-1 (rows sum to 1)" if top1 else "set → set (rows sum to k)",
            )
        )
    )


REPETITION_SERIES = {
    "top1": {
        "top1_repeat": "observed",
        "top1_load": "shuffled (load baseline)",
        "top1_uniform": "uniform random",
    },
    "overlap": {
        "overlap_repeat": "observed",
        "overlap_load": "shuffled (load baseline)",
        "overlap_uniform": "uniform random",
    },
}


def repetition_chart(repetition: pd.DataFrame, kind: str = "top1", *, title: str | None = None) -> alt.Chart:
    """Per layer: how often consecutive tokens repeat their routing, against two random baselines.

    Input: `moeviz.analysis.repetition_frame(trace)` (columns layer, site and top1_repeat, top1_load,
    top1_uniform, overlap_repeat, overlap_load, overlap_uniform). `kind` "top1" = same top-1 expert,
    "overlap" = the two expert sets share at least one expert. Grouped bars: observed, load baseline,
    uniform baseline. Layer labels upright; where they would touch (58 layers at 600 px) on every n-th layer,
    ending on the last (`layer_band_axis`).
    """
    series = REPETITION_SERIES[kind]
    data = repetition.melt(
        id_vars=["site", "layer"], value_vars=list(series), var_name="series", value_name="p"
    )
    data["series"] = data["series"].map(series)
    data["p"] = data["p"].astype(np.float64)
    order = list(series.values())
    return (
        alt.Chart(data)
        .mark_bar()
        .encode(
            x=alt.X(
                "layer:O", title="MoE layer", axis=layer_band_axis(data["layer"].unique(), min_width=600)
            ),
            xOffset=alt.XOffset("series:N", sort=order),
            y=alt.Y("p:Q", title="P(repeat)", scale=alt.Scale(domain=[0, 1])),
            color=alt.Color(
                "series:N", sort=order, scale=alt.Scale(range=["#4c78a8", "#f58518", "#bab0ac"]), title=None
            ),
            tooltip=[alt.Tooltip("layer:O"), alt.Tooltip("series:N"), alt.Tooltip("p:Q", format=".3f")],
        )
        .properties(
            title=title
            or (
                "Consecutive tokens with the same top-1 expert"
                if kind == "top1"
                else "Consecutive tokens sharing an expert"
            ),
            height=220,
            autosize=FIT_WIDTH,
        )
    )


def path_chart(paths: pd.DataFrame, *, title: str | None = None) -> alt.Chart:
    """Horizontal bars of the most frequent top-1 expert paths across layers.

    Input: `moeviz.analysis.path_frame(trace, top_n)` (columns site, rank, label "3→1→7", count, share).
    """
    data = paths[["site", "rank", "label", "count", "share"]].reset_index(drop=True)
    return (
        alt.Chart(data)
        .mark_bar(color="#72b7b2")
        .encode(
            y=alt.Y(
                "label:N",
                sort=alt.EncodingSortField("rank"),
                title="top-1 path (layer order)",
                axis=alt.Axis(labelOverlap=False, labelLimit=0),  # a path of 61 layers is long: all of it
            ),
            x=alt.X("count:Q", title="tokens"),
            tooltip=[
                alt.Tooltip("label:N", title="path"),
                alt.Tooltip("count:Q"),
                alt.Tooltip("share:Q", format=".1%"),
            ],
        )
        .properties(
            title=title or "Most frequent expert paths",
            height=max(CELL * len(data), 80),  # at 18 px a bar (capped) Vega hid every other label
            autosize=FIT_WIDTH,
        )
    )
