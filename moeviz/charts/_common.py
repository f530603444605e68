"""Pieces several chart modules share: layered charts (`layered_chart`), layer row labels, the log₂
fold-change colour of the heatmaps and the two theme colours (INK, PAPER), the fit-to-width autosize
(FIT_WIDTH)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import altair as alt
import numpy as np
import pandas as pd

# Outlines, rules and labels drawn over the page background (not over a coloured cell): dark on the light
# theme; the app swaps this exact value for a light one on the dark theme (`components.exports`).
INK = "#111111"
# Thin separators between heatmap cells: the page background (the app swaps it on the dark theme too).
PAPER = "white"
# Charts take the width of their container (Streamlit's column, a notebook cell), padding included.
FIT_WIDTH = alt.AutoSizeParams(type="fit-x", contains="padding")

# Altair's default data transformer refuses a chart of over 5,000 rows when a notebook displays it (an empty
# cell and a MaxRowsError); views of a 256-expert, 58-layer model carry ~15,000 (Streamlit has no such limit).
# Lifted only while that transformer is active with its default options: a user's own choice stays.
if alt.data_transformers.active == "default" and not alt.data_transformers.options:
    alt.data_transformers.enable("default", max_rows=None)


def layered_chart(*charts: alt.Chart | alt.LayerChart, **kwargs: Any) -> alt.LayerChart:
    """`alt.layer(*charts, **kwargs)` of layers without row/column/facet encodings: a LayerChart (altair
    types `alt.layer` as `LayerChart | FacetChart`: it makes a FacetChart of layers sharing a facet).

    Its top-level properties (title, height, resolve, ...) go in `kwargs`, not in a `.properties()` after:
    every altair method on a layered chart builds it again, deep-copying each layer twice (`_deep_copy`
    of every schema object; ~5 ms for a 6-layer load curve, paid on each Routing layer switch)."""
    chart = alt.layer(*charts, **kwargs)
    assert isinstance(chart, alt.LayerChart)  # no layer of moeviz's charts has a facet encoding
    return chart


def layer_labels(frame: pd.DataFrame) -> list[str]:
    """Row labels of a frame's (site, layer) rows: the layer number, with its site only when several sites
    are present."""
    several = frame["site"].nunique() > 1
    return [
        f"{layer} ({site})" if several else str(layer)
        for site, layer in zip(frame["site"], frame["layer"], strict=True)
    ]


def log2_fold(values: pd.Series) -> np.ndarray:
    """log₂ of a ratio to its reference (1 = as expected), clipped at 8× either way (±3)."""
    return np.log2(np.clip(values.to_numpy(dtype=np.float64), 1 / 8, 8))


def log2_fold_colour(field: str, title: str) -> alt.Color:
    """Diverging colour of a `log2_fold` column: white at 0, red above, blue below, symmetric."""
    return alt.Color(
        f"{field}:Q",
        scale=alt.Scale(scheme="redblue", reverse=True, domain=[-3, 3], domainMid=0),
        # long enough for its five labels (Vega hides touching legend labels)
        legend=alt.Legend(title=title, values=[-3, -1, 0, 1, 3], gradientLength=160, labelOverlap=False),
    )


# ---- axes of many layers or positions --------------------------------------------------------------------


def spaced_ticks(last: int, max_ticks: int) -> list[int]:
    """Integer tick values from 0 to `last` at a round step (1, 2 or 5 × 10ⁿ) giving at most `max_ticks`,
    always ending on `last` itself — the end of the axis is labelled (the last expert, the last token) —
    with the round tick before it dropped when closer than half a step (their labels would touch)."""
    last = max(int(last), 0)
    if last == 0:
        return [0]
    raw = last / max(max_ticks - 1, 1)
    power = 10 ** int(np.floor(np.log10(raw))) if raw >= 1 else 1
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    values = list(range(0, last + 1, step))
    if values[-1] != last:
        if last - values[-1] < step / 2 and len(values) > 1:
            values.pop()
        values.append(last)
    return values


def brushed_ticks(brush: str, field: str, last: int, max_ticks: int) -> alt.ExprRef:
    """Tick values of an axis whose domain follows the interval brush `brush` over `field` (positions
    0…`last` while nothing is brushed): `spaced_ticks` of the positions shown, recomputed by the browser as
    the brush moves, so the axis always ends on its last position shown (Vega's own ticks stop at the last
    round number: 240 of 256 experts). Unbrushed it is exactly `spaced_ticks(last, max_ticks)`."""
    span = f"{brush}.{field}"
    lo = f"max(0, ceil(min({span}[0], {span}[1])))"
    hi = f"min({int(last)}, floor(max({span}[0], {span}[1])))"
    raw = f"(({hi}) - ({lo})) / {max(max_ticks - 1, 1)}"
    power = f"pow(10, floor(log({raw}) / LN10))"
    step = (
        f"(({raw}) <= 1 ? 1 : ({raw}) <= {power} ? {power} : ({raw}) <= 2 * {power} ? 2 * {power} : "
        f"({raw}) <= 5 * {power} ? 5 * {power} : 10 * {power})"
    )
    first = f"ceil(({lo}) / {step}) * {step}"
    # round positions at least half a step before the end (their labels would touch), then the end itself;
    # Vega's expressions cannot concatenate arrays, so the list goes through a string (read back as numbers)
    rounds = f"sequence({first}, ({hi}) - {step} / 2 + 0.5, {step})"
    brushed = (
        f"length({rounds}) ? split(join({rounds}, ',') + ',' + ({hi}), ',') : "
        f"(({first}) < ({hi}) ? [{first}, {hi}] : [{hi}])"
    )
    whole = "[" + ", ".join(str(v) for v in spaced_ticks(last, max_ticks)) + "]"
    brushed = f"({hi}) < ({lo}) ? [] : ({brushed})"  # a brush narrower than one position shows none
    return alt.ExprRef(expr=f"isArray({span}) ? ({brushed}) : {whole}")


def every_nth_layer(layers: Sequence[int], step: int) -> list[int]:
    """Every `step`-th of `layers` (in order) from the first, ending on the last one (the one before it
    dropped when closer than a step: bands are as narrow as the labels allow)."""
    layers = list(layers)
    picked = layers[:: max(step, 1)]
    if layers and picked[-1] != layers[-1]:
        if len(layers) - 1 - layers.index(picked[-1]) < step and len(picked) > 1:
            picked.pop()
        picked.append(layers[-1])
    return picked


LABEL_PX = {0: 20, -90: 13}  # px a layer label needs along the axis: upright two digits, or turned (font 10)


def layer_band_axis(layers: Sequence[int], *, min_width: int, angle: int = 0, **kwargs) -> alt.Axis:
    """A band axis of MoE layers whose labels never overlap and none is dropped by Vega (labelOverlap off):
    every label while each band, at `min_width` px (the narrowest the chart is drawn: a half column is
    ~380 px), has room for one (LABEL_PX at `angle`); beyond, labels on every n-th layer from the first,
    ending on the last (`every_nth_layer`; every bar keeps its layer in the tooltip)."""
    layers = sorted(int(x) for x in layers)
    step = max(1, math.ceil(LABEL_PX[angle] * len(layers) / max(min_width, 1)))
    values = alt.Undefined if step == 1 else every_nth_layer(layers, step)
    return alt.Axis(labelAngle=angle, labelOverlap=False, values=values, **kwargs)
