"""Expert views that stay legible at hundreds of experts (E = 256–384, k = 8, 60 layers, thousands of tokens).

Rules every view here follows:
- never a categorical colour legend over more than `MAX_CATEGORICAL` experts: colour by expert group or on a
  continuous scale by expert id (`expert_colour`), the chosen expert outlined;
- expert and layer axes that would hold more labels than fit are quantitative positions whose ticks Vega
  spaces itself (`labelOverlap` off, so no label is silently dropped), each tick labelled with the expert id
  or layer at that position (`labelExpr` lookup);
- data shipped per chart is bounded by layers × experts (or a per-layer rank window), never by tokens.

Expert axes take an `order`: a permutation (or a subset, to filter) of expert ids, e.g. from
`moeviz.analysis.expert_order.expert_order` / `top_experts`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import altair as alt
import numpy as np
import pandas as pd

from moeviz.charts._common import (
    INK,
    brushed_ticks,
    layer_labels,
    layered_chart,
    log2_fold,
    log2_fold_colour,
    spaced_ticks,
)
from moeviz.charts.raster import (
    OVERLAY_CELLS,
    ColourRamp,
    formatted,
    over_axis,
    png_data_url,
    raster_layers,
    use_raster,
)

MAX_CATEGORICAL = 20  # the most experts (or groups) a categorical legend may list
EXPERT_BRUSH = "experts"  # name of the overview's interval selection over expert positions
HIGHLIGHT = INK  # the chosen expert's outline and label
DOT_COLOUR = "#e4572e"  # dispatched (layer, expert) cells, as in the routing heatmaps
FIT_WIDTH = alt.AutoSizeParams(type="fit-x", contains="padding")
HEATMAP_WIDTH = 700  # px of the overview + detail: with its layer axis it fits the page's column at 1280 px
TICK_SPACING = 40  # px between the expert axis's explicit ticks: three-digit ids never touch
CURVE_TICKS = 14  # ticks of the load curve's rank axis (it fits its column: ~600 px at 1280)


# ---- colour ----------------------------------------------------------------------------------------------
def expert_groups(num_experts: int, n_group: int | None) -> np.ndarray | None:
    """Group of each expert id [E] under DeepSeek-style contiguous groups (E / n_group experts each), or None
    when there are no usable groups (n_group missing, 1, or not dividing E, or more than MAX_CATEGORICAL)."""
    if not n_group or n_group <= 1 or n_group > MAX_CATEGORICAL or num_experts % n_group:
        return None
    return np.arange(num_experts) // (num_experts // n_group)


def group_labels(num_experts: int, n_group: int) -> list[str]:
    """Legend label of each group: "g: first–last" expert ids."""
    size = num_experts // n_group
    return [f"{g}: {g * size}–{(g + 1) * size - 1}" for g in range(n_group)]


def expert_colour(
    num_experts: int,
    *,
    field: str = "expert",
    group_field: str = "group",
    n_group: int | None = None,
    title: str = "expert",
) -> alt.Color:
    """Colour of an expert-valued field that never lists more than MAX_CATEGORICAL legend entries.

    - E ≤ MAX_CATEGORICAL: categorical by expert id (tableau10 / tableau20), one legend entry per expert;
    - grouped router (`n_group` divides E): categorical by `group_field` (≤ MAX_CATEGORICAL groups, labelled
      by their expert range);
    - otherwise: a continuous scale by expert id (`field` as a quantitative value, gradient legend), so that
      neighbouring ids share a hue and no palette repeats.
    Rows without an expert (dropped, -1) should be drawn with a condition (see `token_strip_chart`).
    """
    if num_experts <= MAX_CATEGORICAL:
        domain = [str(e) for e in range(num_experts)]
        return alt.Color(
            f"{field}_label:N",
            scale=alt.Scale(domain=domain, scheme="tableau20" if num_experts > 10 else "tableau10"),
            legend=alt.Legend(title=title, orient="bottom", direction="horizontal", columns=MAX_CATEGORICAL),
            sort=domain,
        )
    if n_group is not None and expert_groups(num_experts, n_group) is not None:
        domain = group_labels(num_experts, int(n_group))
        return alt.Color(
            f"{group_field}:N",
            scale=alt.Scale(domain=domain, scheme="tableau20" if len(domain) > 10 else "tableau10"),
            legend=alt.Legend(title=f"{title} group", orient="bottom", direction="horizontal", columns=5),
            sort=domain,
        )
    return alt.Color(
        f"{field}:Q",
        # turbo without its darkest ends, so that black token text stays readable on every colour
        scale=alt.Scale(
            scheme=alt.SchemeParams("turbo", extent=[0.18, 0.88]), domain=[0, max(num_experts - 1, 1)]
        ),
        legend=alt.Legend(title=f"{title} id", orient="bottom", gradientLength=240),
    )


def add_expert_colour_fields(
    data: pd.DataFrame, num_experts: int, *, field: str = "expert", n_group: int | None = None
) -> pd.DataFrame:
    """The columns `expert_colour` reads, added to `data` (in place and returned): `<field>_label` (id as
    text, "dropped" for -1) and `group` (label of the expert's group, "dropped" for -1) when grouped."""
    ids = data[field].to_numpy()
    data[f"{field}_label"] = np.where(ids >= 0, ids.astype(str), "dropped")
    groups = expert_groups(num_experts, n_group)
    if groups is not None and n_group is not None and num_experts > MAX_CATEGORICAL:
        labels = np.asarray(group_labels(num_experts, int(n_group)), dtype=object)
        safe = np.clip(ids, 0, num_experts - 1)
        data["group"] = np.where(ids >= 0, labels[groups[safe]], "dropped")
    return data


# ---- axes ------------------------------------------------------------------------------------------------
def _lookup_expr(labels: Sequence[str | int]) -> str:
    """A Vega `labelExpr` that labels an integer position tick with labels[position] ('' off the ends)."""
    items = ",".join(f"'{label}'" if isinstance(label, str) else str(int(label)) for label in labels)
    n = len(labels)
    return f"datum.value >= 0 && datum.value < {n} && datum.value % 1 == 0 ? [{items}][datum.value] : ''"


def _position_axis(title: str, labels: Sequence[str | int] | None = None, **kwargs) -> alt.Axis:
    """A quantitative axis over integer positions: Vega picks how many ticks fit, none is dropped
    (labelOverlap off), ticks only at whole positions, each labelled with `labels[position]` if given."""
    extra: dict[str, Any] = {"labelExpr": _lookup_expr(labels)} if labels is not None else {}
    return alt.Axis(title=title, tickMinStep=1, labelOverlap=False, grid=False, **extra, **kwargs)


def _order_positions(
    experts: np.ndarray, order: Sequence[int] | np.ndarray | None
) -> tuple[np.ndarray, list]:
    """Position of each expert id on the axis (-1 = not shown) and the ids in axis order."""
    ids = np.unique(experts[experts >= 0]) if order is None else np.asarray(order, dtype=np.int64)
    size = int(max(experts.max(initial=-1), ids.max(initial=-1))) + 1
    where = np.full(size, -1, dtype=np.int64)
    where[ids] = np.arange(len(ids))
    return np.where(experts >= 0, where[np.clip(experts, 0, None)], -1), ids.tolist()


def _layer_rows(frame: pd.DataFrame) -> tuple[np.ndarray, list[str]]:
    """Index of each row's (site, layer) in sorted order, and the label of each index (see layer_labels)."""
    keys = frame[["site", "layer"]] if "site" in frame else frame[["layer"]].assign(site="mlp")
    unique = keys.drop_duplicates().sort_values(["layer", "site"]).reset_index(drop=True)
    index = pd.MultiIndex.from_frame(unique[["site", "layer"]]).get_indexer(
        pd.MultiIndex.from_frame(keys[["site", "layer"]])
    )
    return index, layer_labels(unique)


# ---- layer × expert heatmap with overview + detail -------------------------------------------------------
def _value_colour(value: str) -> alt.Color:
    """Colour of a heatmap value: utilisation on the log₂ fold scale of its `log2_value` (white = fair
    share, see LOG2_FOLD_EXPR), anything else on a sequential scale of `value`."""
    if value == "utilisation":
        return log2_fold_colour("log2_value", "log₂ utilisation")
    return alt.Color("value:Q", scale=alt.Scale(scheme="viridis"), title=value)


def layer_expert_heatmap(
    frame: pd.DataFrame,
    value: str = "utilisation",
    *,
    order: Sequence[int] | np.ndarray | None = None,
    highlight: int | None = None,
    order_name: str = "id",
    title: str | None = None,
    width: int = HEATMAP_WIDTH,
    colour_scale: alt.Scale | None = None,
    legend_title: str | None = None,
    raster: bool | None = None,
) -> alt.VConcatChart | alt.LayerChart:
    """Layer × expert heatmap of one per-(layer, expert) value, for any number of experts.

    Input: one row per (site, layer, expert), columns layer, expert, `value` (e.g. `expert_balance_frame`:
    value = "utilisation" — white at the fair share, red over, blue under — or "share"/"count"; any other
    per-layer-per-expert frame, e.g. `mean_score_frame` or one token's `token_scores_frame` with value
    "score", on a sequential scale), site optional, count and weight optional (shown on hover), dispatched
    optional (a dot on each dispatched cell, as in `token_layer_scores_chart`). `order`: expert ids in
    axis order (a permutation, or a subset to filter: experts not in it are not drawn), default by id;
    `order_name` says what it is sorted by (axis title).
    `highlight`: an expert whose column is outlined. `colour_scale` / `legend_title`: another scale and
    legend title for a value other than utilisation (default viridis, titled `value`). `raster`: draw the
    views at scale as images (`moeviz.charts.raster`; True/False, default: above RASTER_ABOVE cells and
    without a `colour_scale`).

    Up to MAX_CATEGORICAL experts: one heatmap, every expert and layer labelled (the 8-expert view).
    Above: an overview (every expert at a pixel or two, layers unlabelled) with an interval brush over the
    expert axis (`EXPERT_BRUSH`), and below it the detail: the brushed range of experts at every layer, the
    whole axis while nothing is brushed, both `width` pixels wide (a concatenation cannot fit its host: the
    default, HEATMAP_WIDTH, and the colour legend above rather than beside fit the page at 1280 px, where
    a wider one was cut at its last expert label). The overview's ticks are round positions ending on the
    last expert (`spaced_ticks`); both expert axes keep their end labels inside the plot (labelFlush).
    Expert axes are positions in `order`, ticks labelled with the expert id at that position. Data: one
    row per shown (layer, expert), columns row, layer, expert, pos, value (+ count), shared by both views.
    """
    experts = frame["expert"].to_numpy(dtype=np.int64)
    pos, ids = _order_positions(experts, order)
    keep = pos >= 0
    rows, labels = _layer_rows(frame)
    data = pd.DataFrame(
        {
            "layer": frame["layer"].to_numpy()[keep],
            "row": rows[keep],
            "expert": experts[keep],
            "pos": pos[keep],
            "value": frame[value].to_numpy(dtype=np.float64)[keep],
        }
    )
    for column, dtype in (("count", np.float64), ("weight", np.float64), ("dispatched", bool)):
        if column in frame:
            data[column] = frame[column].to_numpy(dtype=dtype)[keep]
    colour = _value_colour(value)
    if colour_scale is not None and value != "utilisation":
        colour = alt.Color("value:Q", scale=colour_scale, title=legend_title or value)
    tooltip = [
        alt.Tooltip("layer:O"),
        alt.Tooltip("expert:O"),
        alt.Tooltip("value:Q", format=".3f", title=value),
        *([alt.Tooltip("count:Q", title="tokens")] if "count" in data else []),
        *([alt.Tooltip("weight:Q", format=".4f")] if "weight" in data else []),
    ]
    dots = "dispatched" in data and bool(data["dispatched"].any())
    num_rows = len(labels)
    sorted_by = f"experts by {order_name}"
    heading = title or f"{value.capitalize()} per layer and expert"
    if len(ids) <= MAX_CATEGORICAL:
        base = alt.Chart().encode(
            x=alt.X("expert:O", sort=ids, axis=alt.Axis(labelAngle=0, labelOverlap=False), title=sorted_by),
            y=alt.Y(
                "row:O", axis=alt.Axis(title="MoE layer", labelExpr=_lookup_expr(labels), labelOverlap=False)
            ),
        )
        if value == "utilisation":
            data["log2_value"] = log2_fold(data["value"])
        cells = base.mark_rect(stroke="white", strokeWidth=0.5).encode(color=colour, tooltip=tooltip)
        parts = [cells, *_highlight_cells(base, highlight)]
        if dots:
            marked = base.transform_filter("datum.dispatched")
            parts.append(marked.mark_text(text="●", color=DOT_COLOUR, fontSize=11).encode(tooltip=tooltip))
        return layered_chart(
            *parts, data=data, title=heading, height=min(max(26 * num_rows, 100), 700), autosize=FIT_WIDTH
        )
    brush = alt.selection_interval(name=EXPERT_BRUSH, encodings=["x"])
    x_labels = None if order is None and ids == list(range(len(ids))) else ids
    y_scale = alt.Scale(domain=[-0.5, num_rows - 0.5], reverse=True, nice=False, zero=False)
    if colour_scale is None and (use_raster(num_rows, len(ids)) if raster is None else raster):
        return _raster_layer_expert(
            data, value, ids, labels, x_labels, highlight=highlight, dots=dots, heading=heading,
            sorted_by=sorted_by, width=width, brush=brush, y_scale=y_scale,
        )  # fmt: skip
    # Cell edges and the log₂ colour computed here, not by Vega: the browser evaluates a Vega expression
    # per datum through its CSP-safe interpreter (slow at tens of thousands of cells). For the same reason
    # the outlined and dotted cells get their own small data, not a filter over every cell.
    half = 0.5
    data["x0"], data["x1"] = data["pos"] - half, data["pos"] + half
    data["y0"], data["y1"] = data["row"] - half, data["row"] + half
    if value == "utilisation":
        data["log2_value"] = log2_fold(data["value"])

    def view(x_scale: alt.Scale, x_axis: alt.Axis, y_axis: alt.Axis | None, **kwargs) -> alt.Chart:
        return alt.Chart(**kwargs).encode(
            x=alt.X("x0:Q", scale=x_scale, axis=x_axis),
            x2=alt.X2("x1"),
            y=alt.Y("y0:Q", scale=y_scale, axis=y_axis),
            y2=alt.Y2("y1"),
        )

    def outline(x_scale: alt.Scale, x_axis: alt.Axis, y_axis: alt.Axis | None, clip: bool = False) -> list:
        if highlight is None:
            return []
        cells = data.loc[data["expert"].to_numpy() == int(highlight), ["expert", "x0", "x1", "y0", "y1"]]
        outlined = view(x_scale, x_axis, y_axis, data=cells)
        return [outlined.mark_rect(filled=False, stroke=HIGHLIGHT, strokeWidth=1.5, clip=clip)]

    full = alt.Scale(domain=[-0.5, len(ids) - 0.5], nice=False, zero=False)
    colour = _legend_above(colour)
    overview_axis = _position_axis(
        f"{sorted_by} — drag to zoom",
        x_labels,
        values=spaced_ticks(len(ids) - 1, max(width // TICK_SPACING, 2)),
        labelFlush=True,
    )
    # no tooltip in the overview (a cell is a pixel or two wide): the detail below has them
    overview = alt.layer(
        view(full, overview_axis, None).mark_rect().encode(color=colour).add_params(brush),
        *outline(full, overview_axis, None),
        width=width,
        height=min(max(2 * num_rows, 40), 120),
        title=alt.Title(heading, subtitle=_subtitle(len(ids))),
    )
    detail_scale = alt.Scale(domain={"param": EXPERT_BRUSH, "encoding": "x"}, nice=False, zero=False)
    layer_axis = _position_axis("MoE layer", labels, labelFontSize=9)
    detail_axis = _position_axis(
        sorted_by, x_labels, labelFlush=True, values=detail_ticks(len(ids) - 1, width)
    )  # the range is brushed: ticks recomputed as it moves, ending on the last expert shown
    detail_parts = [
        view(detail_scale, detail_axis, layer_axis)
        .mark_rect(clip=True)
        .encode(color=colour, tooltip=tooltip),
        *outline(detail_scale, detail_axis, layer_axis, clip=True),
    ]
    if dots:  # dispatched cells: a dot at the cell centre, in the detail only (a pixel wide in the overview)
        detail_parts.append(
            alt.Chart(data[data["dispatched"].to_numpy()])
            .mark_circle(color=DOT_COLOUR, size=28, opacity=1, clip=True)
            .encode(
                x=alt.X("pos:Q", scale=detail_scale, axis=detail_axis),
                y=alt.Y("row:Q", scale=y_scale, axis=layer_axis),
                tooltip=tooltip,
            )
        )
    detail = alt.layer(
        *detail_parts,
        width=width,
        height=min(max(12 * num_rows, 120), 760),
        title="Detail: brushed experts (all when none)",
    )
    # (passed to the constructor: each altair method call deep-copies the whole chart)
    return alt.VConcatChart(
        vconcat=[overview, detail],
        data=data,
        resolve=alt.Resolve(scale=alt.ScaleResolveMap(color="shared")),
    )


def _raster_layer_expert(
    data: pd.DataFrame,
    value: str,
    ids: list,
    labels: list[str],
    x_labels: list | None,
    *,
    highlight: int | None,
    dots: bool,
    heading: str,
    sorted_by: str,
    width: int,
    brush: alt.Parameter,
    y_scale: alt.Scale,
) -> alt.VConcatChart:
    """`layer_expert_heatmap`'s overview + detail above RASTER_ABOVE cells: each view one image of the
    [layers, experts in axis order] matrix (`moeviz.charts.raster`), the detail with hover bins giving the
    exact values (one expert per bin where they fit, every cell's value listed otherwise) and the legend;
    the chosen expert's column one outline, dispatched cells one dot each. Data: the matrix as a PNG, the
    overlay's bins, the outline and the dots; never one row per cell."""
    num_rows, num_cols = len(labels), len(ids)
    values = np.full((num_rows, num_cols), np.nan)
    values[data["row"].to_numpy(), data["pos"].to_numpy()] = data["value"].to_numpy()
    if value == "utilisation":
        shade = np.where(np.isnan(values), np.nan, log2_fold(pd.Series(values.ravel())).reshape(values.shape))
        ramp = ColourRamp.of("bluered", (-3, 3))
        legend = alt.Legend(
            title="log₂ utilisation", values=[-3, -1, 0, 1, 3], gradientLength=160, labelOverlap=False
        )
    else:
        shade = values
        lo, hi = float(np.nanmin(values)), float(np.nanmax(values))
        ramp = ColourRamp.of("viridis", (lo, hi if hi > lo else lo + 1e-9))
        legend = alt.Legend(title=value, gradientLength=160)
    legend["orient"], legend["direction"] = "top", "horizontal"
    full = alt.Scale(domain=[-0.5, num_cols - 0.5], nice=False, zero=False)
    overview_axis = _position_axis(
        f"{sorted_by} — drag to zoom",
        x_labels,
        values=spaced_ticks(num_cols - 1, max(width // TICK_SPACING, 2)),
        labelFlush=True,
    )
    common: dict[str, Any] = dict(
        row_title="layer", col_title="expert", value_title=value, row_labels=labels, col_labels=ids,
        legend=legend, hover=values if value == "utilisation" else None, value_format=".3f",
    )  # fmt: skip
    common["image_url"] = png_data_url(shade, ramp)  # one PNG for the overview and the detail
    image, *_ = raster_layers(
        shade, ramp, x_scale=full, y_scale=y_scale, x_axis=overview_axis, y_axis=None, overlay=False, **common
    )

    def outline(x_scale: alt.Scale, x_axis: Any, y_axis: Any, clip: bool = False) -> list:
        if highlight is None or int(highlight) not in ids:
            return []
        pos = ids.index(int(highlight))
        column = pd.DataFrame({"expert": [int(highlight)], "x0": [pos - 0.5], "x1": [pos + 0.5]})
        column["y0"], column["y1"] = -0.5, num_rows - 0.5
        return [
            alt.Chart(column)
            .mark_rect(filled=False, stroke=HIGHLIGHT, strokeWidth=1.5, clip=clip)
            .encode(
                x=alt.X("x0:Q", scale=x_scale, axis=x_axis),
                x2=alt.X2("x1"),
                y=alt.Y("y0:Q", scale=y_scale, axis=y_axis),
                y2=alt.Y2("y1"),
            )
        ]

    overview = alt.layer(
        image.add_params(brush),
        *outline(full, over_axis(overview_axis), None),
        width=width,
        height=min(max(2 * num_rows, 40), 120),
        title=alt.Title(heading, subtitle=_subtitle(num_cols)),
    )
    detail_scale = alt.Scale(domain={"param": EXPERT_BRUSH, "encoding": "x"}, nice=False, zero=False)
    layer_axis = _position_axis("MoE layer", labels, labelFontSize=9)
    detail_axis = _position_axis(
        sorted_by, x_labels, labelFlush=True, values=detail_ticks(num_cols - 1, width)
    )
    detail_parts = [
        *raster_layers(
            shade, ramp, x_scale=detail_scale, y_scale=y_scale, x_axis=detail_axis, y_axis=layer_axis,
            clip=True, max_cells=OVERLAY_CELLS, **common,
        ),
        *outline(detail_scale, over_axis(detail_axis), over_axis(layer_axis), clip=True),
    ]  # fmt: skip
    if dots:
        marked = data[data["dispatched"].to_numpy()]
        detail_parts.append(
            alt.Chart(marked[["layer", "expert", "pos", "row", "value"]])
            .mark_circle(color=DOT_COLOUR, size=28, opacity=1, clip=True)
            .encode(
                x=alt.X("pos:Q", scale=detail_scale, axis=over_axis(detail_axis)),
                y=alt.Y("row:Q", scale=y_scale, axis=over_axis(layer_axis)),
                tooltip=[
                    alt.Tooltip("layer:O"),
                    alt.Tooltip("expert:O"),
                    alt.Tooltip("value:Q", format=".3f", title=value),
                ],
            )
        )
    detail = alt.layer(
        *detail_parts,
        width=width,
        height=min(max(12 * num_rows, 120), 760),
        title="Detail: brushed experts (all when none)",
    )
    return alt.VConcatChart(vconcat=[overview, detail])


def detail_ticks(last: int, width: int) -> alt.ExprRef:
    """Ticks of the detail's expert axis (positions 0…`last`, `width` px): `brushed_ticks` of the overview's
    brush, as many as the overview's own (one per TICK_SPACING px), ending on the last expert shown."""
    return brushed_ticks(EXPERT_BRUSH, "x0", last, max(width // TICK_SPACING, 2))


def _legend_above(colour: alt.Color) -> alt.Color:
    """`colour` with its legend above the charts, horizontal: beside them it adds ~110 px to a fixed width."""
    legend = colour._kwds.get("legend", alt.Undefined)
    kwds = {} if legend is alt.Undefined or legend is None else dict(legend._kwds)
    kwds = {k: v for k, v in kwds.items() if v is not alt.Undefined}
    kwds.update(orient="top", direction="horizontal")
    colour["legend"] = alt.Legend(**kwds)
    return colour


def _subtitle(num_experts: int) -> str:
    return f"{num_experts} experts; drag over the overview to show a range in detail"


def _highlight_cells(base: alt.Chart, highlight: int | None, clip: bool = False) -> list[alt.Chart]:
    if highlight is None:
        return []
    return [
        base.transform_filter(f"datum.expert == {int(highlight)}").mark_rect(
            filled=False, stroke=HIGHLIGHT, strokeWidth=1.5, clip=clip
        )
    ]


# ---- one token's path as layer × expert rank -------------------------------------------------------------
RANK_BY = ("score", "selection_score", "load")


def token_rank_path_chart(
    token_scores: pd.DataFrame,
    *,
    rank_by: str = "score",
    load: pd.DataFrame | None = None,
    max_rank: int | None = None,
    title: str | None = None,
    raster: bool | None = None,
) -> alt.LayerChart:
    """One token's expert path as layer × expert rank: where, at each layer, the experts it was dispatched to
    stand in that layer's ranking, so the view has the same shape for 8 or 384 experts.

    Input: the stacked scores frame (`moeviz.charts.stack_scores`) filtered to one token: columns layer,
    expert, score, weight, dispatched, site optional, selection_score needed for rank_by="selection_score".
    `rank_by`:
    - "score" / "selection_score": rank among all experts of the token's own router score (p) or of what
      the experts were selected on (p + balancing bias); the background shows the score of every rank down
      to the deepest dispatched one (at least 2k, `max_rank` caps the background, never a dispatched rank);
      a dispatched expert off the top-k ranks was promoted by a bias or a group limit;
    - "load": rank of each dispatched expert by that layer's load (0 = busiest), from `load`
      (`expert_balance_frame` rows: layer, expert, count, site optional); only the dispatched experts.
    Dots: dispatched experts, sized by weight, coloured by slot (0 = largest weight); the top-1 slot joined
    across layers (routing without weights, an engine import: one size and colour, no line; rank it by
    "load", its scores being NaN). Rows shipped: layers × (ranks shown), at most layers × E; above
    RASTER_ABOVE cells (`raster`: True/False to choose) the background is an image of the [ranks, layers]
    scores with hover bins naming each cell's expert (`moeviz.charts.raster`), and the rows shipped are the
    dispatched ones.
    """
    if rank_by not in RANK_BY:
        raise ValueError(f"rank_by must be one of {RANK_BY}, got {rank_by!r}")
    frame = token_scores.reset_index(drop=True)
    frame = frame if "site" in frame else frame.assign(site="mlp")
    values_field = "selection_score" if rank_by == "selection_score" else "score"
    if rank_by == "load":
        if load is None:
            raise ValueError("rank_by='load' needs `load` (expert_balance_frame rows)")
        key = ["site", "layer", "expert"]
        loads = load if "site" in load else load.assign(site="mlp")
        frame = frame.merge(loads[[*key, "count"]], on=key, how="left")
        rank_value = frame["count"].fillna(0).to_numpy(dtype=np.float64)
    else:
        rank_value = frame[values_field].to_numpy(dtype=np.float64)
    frame = frame.assign(_v=-rank_value).sort_values(["layer", "site", "_v", "expert"], kind="stable")
    frame["rank"] = frame.groupby(["layer", "site"], sort=False).cumcount()
    dispatched = frame["dispatched"].to_numpy(dtype=bool)
    k = int(frame[dispatched].groupby(["layer", "site"]).size().max()) if dispatched.any() else 1
    deepest = int(frame.loc[dispatched, "rank"].max()) if dispatched.any() else 0
    if rank_by == "load":
        shown = dispatched
    else:
        cap = max(2 * k, 16) if max_rank is None else max_rank
        shown = dispatched | (frame["rank"].to_numpy() < max(cap, deepest + 1 if max_rank is None else 0))
    data = frame[shown].reset_index(drop=True)
    rows, labels = _layer_rows(data)
    slot = data.assign(_w=-data["weight"].astype(np.float64))
    slot = slot[slot["dispatched"]].sort_values(["layer", "site", "_w", "expert"], kind="stable")
    slot_of = slot.groupby(["layer", "site"], sort=False).cumcount()
    data = pd.DataFrame(
        {
            "row": rows,
            "layer": data["layer"].to_numpy(),
            "expert": data["expert"].to_numpy(dtype=np.int64),
            "rank": data["rank"].to_numpy(dtype=np.int64),
            "score": data[values_field].to_numpy(dtype=np.float64),
            "weight": data["weight"].to_numpy(dtype=np.float64),
            "dispatched": data["dispatched"].to_numpy(dtype=bool),
            "slot": pd.Series(slot_of.to_numpy(), index=slot.index)
            .reindex(range(len(data)))
            .fillna(-1)
            .astype(int),
        }
    )
    top = int(data["rank"].max()) + 1 if len(data) else 1
    num_rows = len(labels)
    x_scale = alt.Scale(domain=[-0.5, num_rows - 0.5], nice=False, zero=False)
    x_axis = _position_axis("MoE layer", labels, labelAngle=0)
    x = alt.X("row:Q", scale=x_scale, axis=x_axis)
    y_scale = alt.Scale(domain=[-0.5, top - 0.5], reverse=True, nice=False, zero=False)
    rank_title = {
        "score": "rank by router score",
        "selection_score": "rank by selection score (p + b)",
        "load": "rank by layer load (0 = busiest)",
    }[rank_by]
    y_axis = _position_axis(rank_title)
    rastered = rank_by != "load" and (use_raster(top, num_rows) if raster is None else raster)
    # its numbers formatted here, not by d3-format per cell in the browser (thousands of cells); behind a
    # raster only the dispatched rows (the dots) carry a tooltip of their own
    texted = data["dispatched"].to_numpy(dtype=bool) if rastered else slice(None)
    for field, column in (("score_text", "score"), ("weight_text", "weight")):
        data[field] = ""
        data.loc[texted, field] = formatted(data.loc[texted, column].to_numpy(), ".4f")
    tooltip = [
        alt.Tooltip("layer:O"),
        alt.Tooltip("expert:O"),
        alt.Tooltip("rank:Q"),
        alt.Tooltip("score_text:N", title=values_field),
        alt.Tooltip("weight_text:N", title="weight"),
        alt.Tooltip("dispatched:N"),
    ]
    parts: list[alt.Chart] = []
    if rastered:
        parts = _rank_background(data, top, labels, values_field, x_scale, y_scale, x_axis, y_axis)
        x, y_axis = alt.X("row:Q", scale=x_scale, axis=over_axis(x_axis)), over_axis(y_axis)
    elif rank_by != "load":
        # cell edges computed here, not by Vega: the browser evaluates a Vega expression per row through its
        # CSP-safe interpreter (four per cell, thousands of cells at hundreds of experts)
        data["x0"], data["x1"] = data["row"] - 0.5, data["row"] + 0.5
        data["y0"], data["y1"] = data["rank"] - 0.5, data["rank"] + 0.5
        parts.append(
            alt.Chart()
            .mark_rect()
            .encode(
                x=alt.X("x0:Q", scale=x_scale, axis=x_axis),
                x2=alt.X2("x1"),
                y=alt.Y("y0:Q", scale=y_scale, axis=y_axis),
                y2=alt.Y2("y1"),
                color=alt.Color("score:Q", scale=alt.Scale(scheme="greys"), title=values_field),
                tooltip=tooltip,
            )
        )
    # the dispatched experts (k a layer) with data of their own, not a filter the browser runs per cell
    chosen = data[data["dispatched"].to_numpy()]
    picked = alt.Chart(chosen)
    line = (
        alt.Chart(chosen[chosen["slot"].to_numpy() == 0])
        .mark_line(color="#888", strokeDash=[4, 3])
        .encode(x=x, y=alt.Y("rank:Q", scale=y_scale, axis=y_axis))
    )
    # without weights (an engine import records only the chosen experts) the slots have no order here:
    # one size, one colour, no top-1 line
    weighted = bool(np.isfinite(data.loc[data["dispatched"], "weight"]).any())
    dots = picked.mark_circle(opacity=0.95, stroke="white", strokeWidth=0.5).encode(
        x=x,
        y=alt.Y("rank:Q", scale=y_scale, axis=y_axis),
        size=alt.Size(
            "weight:Q",
            scale=alt.Scale(range=[8, 90] if num_rows > 16 else [20, 300]),
            title="weight",
            # in the ink of the page's theme (a host swaps INK on a dark page): by default Vega's blue,
            # hardly seen on a dark background
            legend=alt.Legend(symbolFillColor=INK),
        )
        if weighted
        else alt.value(60 if num_rows > 16 else 160),
        # every one of the k slots in one row under the chart: stacked beside the weight and score legends
        # the list outgrew the chart's height and was cut (5 of 8 shown)
        color=alt.Color(
            "slot:O",
            title="slot",
            scale=alt.Scale(scheme="viridis", domain=list(range(k))),
            legend=alt.Legend(values=list(range(k)), orient="bottom", direction="horizontal", columns=k),
        )
        if weighted
        else alt.value("#4c78a8"),
        tooltip=tooltip
        if weighted
        else [t for t in tooltip if t.shorthand not in ("weight_text:N", "score_text:N")],
    )
    marks = [*parts, line, dots] if weighted else [*parts, dots]
    # the raster's layers and the dots carry their own data: the cells are not shipped besides
    return layered_chart(
        *marks,
        data=alt.Undefined if rastered else data,
        resolve=alt.Resolve(scale=alt.ScaleResolveMap(color="independent")),
        title=alt.Title(title or "Expert path by rank", subtitle=f"{rank_title}; {k} experts per layer"),
        height=min(max(14 * top, 160), 520),
        autosize=FIT_WIDTH,
    )


def _rank_background(
    data: pd.DataFrame,
    top: int,
    labels: list[str],
    values_field: str,
    x_scale: alt.Scale,
    y_scale: alt.Scale,
    x_axis: alt.Axis,
    y_axis: alt.Axis,
) -> list[alt.Chart]:
    """`token_rank_path_chart`'s background above RASTER_ABOVE cells: the [ranks, layers] matrix of scores
    as one image (greys, NaN where a layer shows no such rank) and its hover bins, each cell listed as
    "rank expert: score"."""
    matrix = np.full((top, len(labels)), np.nan)
    cells = np.full((top, len(labels)), "", dtype=object)
    rank, row = data["rank"].to_numpy(), data["row"].to_numpy()
    matrix[rank, row] = data["score"].to_numpy(dtype=np.float64)
    cells[rank, row] = [f"{r} e{e}" for r, e in zip(rank, data["expert"].to_numpy(), strict=True)]
    finite = matrix[np.isfinite(matrix)]
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    return raster_layers(
        matrix,
        ColourRamp.of("greys", (lo, hi if hi > lo else lo + 1e-9)),
        x_scale=x_scale,
        y_scale=y_scale,
        x_axis=x_axis,
        y_axis=y_axis,
        row_title="rank",
        col_title="layer",
        value_title=values_field,
        col_labels=labels,
        value_format=".4f",
        cell_labels=cells,
    )


# ---- load of many experts as a sorted curve --------------------------------------------------------------
def _utilisation_bands(data: pd.DataFrame, bands: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Each row's bootstrap band of `bands` (columns expert, share, share_low, share_high) as utilisation
    (low, high), aligned to `data`'s rows by expert. The factor utilisation / share (E for
    `expert_balance_frame`: u = c/(kT/E), f = c/(kT)) is read from the experts with a load, E otherwise."""
    band = bands.drop_duplicates("expert").set_index("expert")
    share = data["expert"].map(band["share"]).to_numpy(np.float64)
    util = data["utilisation"].to_numpy(np.float64)
    known = np.isfinite(share) & np.isfinite(util) & (share > 0)
    factor = float(np.median(util[known] / share[known])) if known.any() else float(len(data))
    low = data["expert"].map(band["share_low"]).to_numpy(np.float64) * factor
    high = data["expert"].map(band["share_high"]).to_numpy(np.float64) * factor
    return low, high


def expert_load_curve_chart(
    balance_rows: pd.DataFrame,
    *,
    highlight: int | None = None,
    title: str | None = None,
    bands: pd.DataFrame | None = None,
) -> alt.LayerChart:
    """One layer's expert load as a sorted curve (busiest first) against the fair share, instead of E bars.

    Input: the rows of `moeviz.analysis.expert_balance_frame(trace)` for one (layer, site): columns expert,
    count, utilisation (count / (kT/E): 1 = fair share), share optional, dead optional. Dropped slots are
    not experts and are not drawn. y = utilisation (log scale would hide the dead: linear, dead at 0); a
    dashed rule at 1 (the fair share). `highlight`: an expert marked on the curve with its id.

    `bands`: the layer's bootstrap bands (columns expert, share, share_low, share_high: the frame of
    `moeviz.analysis.null.expert_confidence_frame` for one layer, or the app's `layer_load_bands`): a light
    band from each expert's low to high utilisation (share × utilisation/share, i.e. × E), at the expert's
    rank on the curve; the tooltip gains the band. One row per expert, bands included.
    """
    frame = balance_rows[balance_rows["expert"] >= 0]
    counts = frame["count"].to_numpy(dtype=np.float64)
    if "utilisation" in frame:
        util = frame["utilisation"].to_numpy(dtype=np.float64)
    else:
        util = counts / counts.mean() if len(counts) and counts.mean() > 0 else np.zeros(len(counts))
    data = pd.DataFrame(
        {"expert": frame["expert"].to_numpy(dtype=np.int64), "count": counts, "utilisation": util}
    )
    if "share" in frame:
        data["share"] = frame["share"].to_numpy(dtype=np.float64)
    data = data.sort_values(["count", "expert"], ascending=[False, True], kind="stable").reset_index(
        drop=True
    )
    data["rank"] = np.arange(len(data))
    e = len(data)
    dead = int((data["count"] == 0).sum())
    if bands is not None:
        data["util_low"], data["util_high"] = _utilisation_bands(data, bands)
    tooltip = [
        alt.Tooltip("rank:Q", title="rank (0 = busiest)"),
        alt.Tooltip("expert:O"),
        alt.Tooltip("count:Q", title="tokens"),
        *([alt.Tooltip("share:Q", format=".2%")] if "share" in data else []),
        alt.Tooltip("utilisation:Q", format=".2f", title="utilisation (1 = fair)"),
        *(
            [
                alt.Tooltip("util_low:Q", format=".2f", title="band low (utilisation)"),
                alt.Tooltip("util_high:Q", format=".2f", title="band high (utilisation)"),
            ]
            if bands is not None
            else []
        ),
    ]
    x = alt.X(
        "rank:Q",
        scale=alt.Scale(domain=[0, max(e - 1, 1)], nice=False),
        axis=_position_axis(
            "experts, busiest first", values=spaced_ticks(max(e - 1, 1), CURVE_TICKS), labelFlush=True
        ),
    )
    y = alt.Y(
        "utilisation:Q",
        title="utilisation (1 = fair share)",
        scale=alt.Scale(zero=True),
        axis=alt.Axis(labelOverlap=False),
    )
    base = alt.Chart().encode(x=x, y=y)
    area = base.mark_area(interpolate="step-after", opacity=0.35, color="#4c78a8", line={"color": "#4c78a8"})
    points = base.mark_circle(size=18 if e > 64 else 40, color="#4c78a8", opacity=0.8).encode(tooltip=tooltip)
    # one rule, from the busiest expert's row: on every row of the layer's data it would be drawn once per
    # expert, E rules on top of each other for the browser to encode and paint on every redraw
    fair = (
        alt.Chart()
        .transform_filter("datum.rank == 0")
        .mark_rule(color="#e4572e", strokeDash=[6, 4], strokeWidth=2)
        .encode(y=alt.YDatum(1.0))
    )
    parts = [area, points, fair]
    if bands is not None:
        band = alt.Chart().mark_area(interpolate="step-after", opacity=0.3, color="#9e9e9e")
        band = band.encode(
            x=x,
            y=alt.Y("util_low:Q", title="utilisation (1 = fair share)", axis=alt.Axis(labelOverlap=False)),
            y2=alt.Y2("util_high:Q"),
            tooltip=tooltip,
        )
        parts.insert(1, band)
    if highlight is not None:
        data["chosen"] = data["expert"] == int(highlight)  # in the data: another choice keeps the spec
        chosen = base.transform_filter("datum.chosen")
        parts += [
            chosen.mark_point(size=140, color=HIGHLIGHT, strokeWidth=2, filled=False).encode(tooltip=tooltip),
            chosen.mark_text(dy=-14, color=HIGHLIGHT, fontWeight="bold").encode(text=alt.Text("expert:O")),
        ]
    top = data["utilisation"].max() if e else 0
    subtitle = f"{e} experts, {dead} dead, busiest at {top:.2f}× its fair share; dashed = fair share"
    if bands is not None:
        subtitle += "; grey = bootstrap band"
    return layered_chart(
        *parts,
        data=data,
        title=alt.Title(title or "Expert load, sorted", subtitle=subtitle),
        height=220,
        autosize=FIT_WIDTH,
    )


# ---- an expert order carried by the data -------------------------------------------------------------------
ORDER_FIELD = "expert_rank"  # the column `order_in_data` adds: each row's expert's place in the order
_Ordered = TypeVar("_Ordered", alt.Chart, alt.LayerChart)


def order_in_data(chart: _Ordered, order: Sequence[int], channel: str = "y") -> _Ordered:
    """Put the experts of `chart`'s `channel` axis in `order` through a column of its data (ORDER_FIELD:
    each row's expert's place in `order`; experts not in it after) rather than a list of ids in the spec.
    A new order, or a new expert among those shown, then changes the chart's data alone: a host that keeps
    a drawn chart whose spec is unchanged (Streamlit) patches the data in, instead of compiling and drawing
    a new chart. `chart`: a chart or layered chart whose data (top level) is a frame with an `expert`
    column. Changed in place (every view with that channel) and returned."""
    if not isinstance(chart.data, pd.DataFrame):
        raise TypeError("order_in_data needs a chart whose data is a DataFrame")
    place = {int(e): i for i, e in enumerate(order)}
    experts = chart.data["expert"].to_numpy()
    ranks = np.fromiter((place.get(int(e), len(place)) for e in experts), np.int32, len(experts))
    chart.data = chart.data.assign(**{ORDER_FIELD: ranks})
    views = list(chart.layer) if isinstance(chart, alt.LayerChart) else [chart]
    for view in views:
        if view.encoding is alt.Undefined or getattr(view.encoding, channel, alt.Undefined) is alt.Undefined:
            continue
        # item access: a channel's attributes are altair's chained setters (`alt.Y(...).axis(...)`)
        view.encoding[channel]["sort"] = alt.EncodingSortField(field=ORDER_FIELD, op="min", order="ascending")
    return chart
