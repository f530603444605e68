"""Dense matrices drawn as one image instead of one SVG/canvas mark per cell.

A layer × expert table at 256 experts × 58 layers, or one head's 1000 × 1000 attention map, is tens of
thousands to a million cells: as marks, the browser parses and draws each (seconds per redraw). Here the
matrix is coloured in numpy (`ColourRamp`), encoded as a PNG data URL (`png_data_url`) at one pixel per cell,
upscaled by a whole factor (`upscale`) so that cells stay sharp when the browser scales it, and placed as an
image mark (`raster_layers`) whose edges sit on the cell edges of quantitative position axes
([-0.5, n - 0.5]). Exact values on hover come from a coarse transparent overlay (`overlay_frame`: one rect
per bin of cells, its mean, min and max, and each cell's value when a bin holds few), which also carries the
colour legend, drawn from the same stops as the pixels (`ColourRamp.scale`).

Views switch to a raster above `RASTER_ABOVE` cells (`use_raster`); below, they keep one rect per cell.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import math
from collections.abc import Sequence
from typing import Any

import altair as alt
import numpy as np
import pandas as pd

from moeviz.charts._common import layered_chart
from moeviz.settings import current_settings

# cells: a heatmap with more is drawn as an image (the setting MOEVIZ_RASTER_ABOVE overrides it)
RASTER_ABOVE = 4000
# the most hover bins of a raster's overlay: each is a mark the browser builds (through Vega's slow CSP-safe
# interpreter), ~1,800 of them were half a token's drill-down; at 58 layers × 256 experts, bins of 16
OVERLAY_CELLS = 1_000
MIN_IMAGE_PX = 600  # a raster is upscaled (whole factor) to at least this many pixels along each axis
MAX_IMAGE_PX = 2_048  # … but never past this many along either axis
LISTED_CELLS = 16  # a bin of at most this many cells lists each cell's value in its tooltip

# Colour stops (hex) of the ramps, low to high, sampled from the d3/Vega schemes of the same names; the
# raster interpolates between them in RGB, as the legend's Vega scale does (`ColourRamp.scale`).
SCHEMES: dict[str, tuple[str, ...]] = {
    name: tuple(stops.split())
    for name, stops in {
        "viridis": "#440154 #482878 #3e4989 #31688e #26828e #1f9e89 #35b779 #6ece58 #b5de2b #fde725",
        "blues": "#f7fbff #deebf7 #c6dbef #9ecae1 #6baed6 #4292c6 #2171b5 #08519c #08306b",
        "purples": "#fcfbfd #efedf5 #dadaeb #bcbddc #9e9ac8 #807dba #6a51a3 #54278f #3f007d",
        "greys": "#ffffff #f0f0f0 #d9d9d9 #bdbdbd #969696 #737373 #525252 #252525 #000000",
        # blue (low) – white (middle) – red (high): Vega's "redblue" reversed, as the log₂ fold heatmaps
        "bluered": "#053061 #2166ac #4393c3 #92c5de #d1e5f0 #f7f7f7 #fddbc7 #f4a582 #d6604d #b2182b #67001f",
    }.items()
}
MISSING = (217, 217, 217)  # cells without a value (NaN): light grey


def hex_rgb(colour: str) -> tuple[int, int, int]:
    """(r, g, b) of a "#rrggbb" colour."""
    return int(colour[1:3], 16), int(colour[3:5], 16), int(colour[5:7], 16)


@dataclasses.dataclass(frozen=True)
class ColourRamp:
    """A continuous colour scale: `colours` at evenly spaced values from `domain[0]` to `domain[1]`
    (log-spaced with `log`), linear in RGB between them, values outside clamped to the ends."""

    colours: tuple[str, ...]
    domain: tuple[float, float]
    log: bool = False

    @classmethod
    def of(cls, scheme: str, domain: Sequence[float], *, log: bool = False) -> ColourRamp:
        if scheme not in SCHEMES:
            raise ValueError(f"unknown colour scheme {scheme!r}; one of {sorted(SCHEMES)}")
        lo, hi = float(domain[0]), float(domain[1])
        if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo or (log and lo <= 0):
            raise ValueError(f"a colour domain needs finite lo < hi (lo > 0 on a log scale), got {domain}")
        return cls(SCHEMES[scheme], (lo, hi), log)

    def stops(self) -> np.ndarray:
        """[S] the value at each colour stop."""
        lo, hi = self.domain
        if self.log:
            return np.logspace(math.log10(lo), math.log10(hi), len(self.colours))
        return np.linspace(lo, hi, len(self.colours))

    def rgb(self, values: np.ndarray) -> np.ndarray:
        """[..., 3] uint8 colour of each value ([...]); NaN → MISSING."""
        values = np.asarray(values, dtype=np.float64)
        lo, hi = self.domain
        clipped = np.clip(np.nan_to_num(values, nan=lo), lo, hi)
        position = np.log10(clipped) if self.log else clipped
        stops = np.log10(self.stops()) if self.log else self.stops()
        table = np.array([hex_rgb(c) for c in self.colours], dtype=np.float64)  # [S, 3]
        channels = [np.interp(position, stops, table[:, i]) for i in range(3)]
        out = np.floor(np.stack(channels, axis=-1) + 0.5).astype(np.uint8)  # rounded as d3's rgb()
        out[np.isnan(values)] = MISSING
        return out

    def scale(self) -> alt.Scale:
        """The Vega scale of the same colours (for the legend and any rect drawn next to the raster)."""
        return alt.Scale(
            type="log" if self.log else "linear",
            domain=[float(v) for v in self.stops()],
            range=list(self.colours),
            interpolate="rgb",
            clamp=True,
        )


def upscale(pixels: np.ndarray, factor_y: int, factor_x: int) -> np.ndarray:
    """[R·fy, C·fx, ...] each pixel repeated into a block: cells stay sharp-edged when the browser scales
    the image (Vega's image mark may smooth it)."""
    return np.repeat(np.repeat(pixels, factor_y, axis=0), factor_x, axis=1)


def upscale_factors(rows: int, cols: int) -> tuple[int, int]:
    """Whole factors (fy, fx) bringing each axis to at least MIN_IMAGE_PX pixels, at most MAX_IMAGE_PX."""

    def factor(n: int) -> int:
        return max(1, min(math.ceil(MIN_IMAGE_PX / max(n, 1)), MAX_IMAGE_PX // max(n, 1)))

    return factor(rows), factor(cols)


def encode_png(pixels: np.ndarray) -> bytes:
    """PNG bytes of a [H, W, 3] uint8 image (RGB, no smoothing, lossless)."""
    from PIL import Image

    pixels = np.ascontiguousarray(pixels, dtype=np.uint8)
    if pixels.ndim != 3 or pixels.shape[2] != 3:
        raise ValueError(f"pixels must be [H, W, 3] uint8, got shape {pixels.shape}")
    buffer = io.BytesIO()
    Image.fromarray(pixels, mode="RGB").save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()


def png_data_url(matrix: np.ndarray, ramp: ColourRamp, *, factors: tuple[int, int] | None = None) -> str:
    """A data URL of `matrix` [R, C] as a PNG: row 0 at the top, column 0 at the left, one pixel per cell
    coloured by `ramp`, upscaled by `factors` (default `upscale_factors`)."""
    matrix = np.asarray(matrix, dtype=np.float64)
    if matrix.ndim != 2 or 0 in matrix.shape:
        raise ValueError(f"a raster needs a non-empty [rows, columns] matrix, got shape {matrix.shape}")
    fy, fx = factors or upscale_factors(*matrix.shape)
    png = encode_png(upscale(ramp.rgb(matrix), fy, fx))
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def use_raster(rows: int, cols: int, threshold: int | None = None) -> bool:
    """Whether a rows × cols heatmap is drawn as a raster: more than `threshold` cells (None: the setting
    MOEVIZ_RASTER_ABOVE, else RASTER_ABOVE)."""
    if threshold is None:
        setting = current_settings().raster_above
        threshold = RASTER_ABOVE if setting is None else setting
    return rows * cols > threshold


# ---- the hover overlay -----------------------------------------------------------------------------------
def overlay_bins(rows: int, cols: int, max_cells: int = OVERLAY_CELLS) -> tuple[int, int]:
    """Cells per bin (along rows, along columns) so that the bins number at most `max_cells`. Few rows (58
    layers × 256 experts): one row per bin of at most LISTED_CELLS columns (a bin reads "layer 21, experts
    84–89" and lists each cell); few columns (256 ranks × 58 layers), the same along a column (where both
    fit, along the shorter axis);
    else the axis with more bins is coarsened first, so bins stay about as many along each axis."""
    if rows * cols <= max_cells:
        return 1, 1
    along_row = math.ceil(cols / (max_cells // rows)) if rows <= max_cells else None
    along_column = math.ceil(rows / (max_cells // cols)) if cols <= max_cells else None
    if along_column is not None and along_column <= LISTED_CELLS and cols < rows:
        return along_column, 1
    if along_row is not None and along_row <= LISTED_CELLS:
        return 1, along_row
    if along_column is not None and along_column <= LISTED_CELLS:
        return along_column, 1
    by_row, by_col = 1, 1
    while math.ceil(rows / by_row) * math.ceil(cols / by_col) > max_cells:
        if math.ceil(rows / by_row) >= math.ceil(cols / by_col):
            by_row += 1
        else:
            by_col += 1
    return by_row, by_col


def _blocks(matrix: np.ndarray, by_row: int, by_col: int) -> np.ndarray:
    """[bins down, bins across, by_row · by_col] the cells of each bin of `matrix` [R, C], row by row, NaN
    past its edges."""
    rows, cols = matrix.shape
    n_r, n_c = math.ceil(rows / by_row), math.ceil(cols / by_col)
    padded = np.full((n_r * by_row, n_c * by_col), np.nan)
    padded[:rows, :cols] = matrix
    return padded.reshape(n_r, by_row, n_c, by_col).transpose(0, 2, 1, 3).reshape(n_r, n_c, -1)


def _finite_mean(blocks: np.ndarray) -> np.ndarray:
    """[bins down, bins across] the mean of each bin's finite cells, NaN where it has none."""
    finite = np.isfinite(blocks)
    count = finite.sum(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, np.where(finite, blocks, 0.0).sum(-1) / np.maximum(count, 1), np.nan)


def binned_mean(matrix: np.ndarray, max_cells: int = OVERLAY_CELLS) -> np.ndarray:
    """[bins] `overlay_frame(matrix, max_cells=max_cells)["mean"]` without the bins' labels and listings."""
    matrix = np.asarray(matrix, dtype=np.float64)
    rows, cols = matrix.shape
    return _finite_mean(_blocks(matrix, *overlay_bins(rows, cols, max_cells))).ravel()


def overlay_frame(
    matrix: np.ndarray,
    *,
    row_labels: Sequence | None = None,
    col_labels: Sequence | None = None,
    max_cells: int = OVERLAY_CELLS,
    value_format: str = "{:.4g}",
    cell_labels: np.ndarray | None = None,
) -> pd.DataFrame:
    """One row per bin of `matrix` [R, C] (`overlay_bins`): its edges in cell positions (x0, x1, y0, y1:
    column and row ± 0.5), the rows and columns it covers as labels (row_from, row_to, col_from, col_to:
    `row_labels[i]`, default the index), mean / min / max over its finite cells (NaN when none), and
    `values`: each cell's value ("label: value" joined by " · ") when it holds at most LISTED_CELLS cells,
    else "". A cell's label is its column's or row's (the other is the bin's one; both in a bin of several
    rows and columns), or `cell_labels[r, c]` [R, C] when given (what sits in the cell: a layer's expert at
    a rank)."""
    matrix = np.asarray(matrix, dtype=np.float64)
    rows, cols = matrix.shape
    row_labels = list(range(rows)) if row_labels is None else list(row_labels)
    col_labels = list(range(cols)) if col_labels is None else list(col_labels)
    by_row, by_col = overlay_bins(rows, cols, max_cells)
    n_r, n_c = math.ceil(rows / by_row), math.ceil(cols / by_col)
    blocks = _blocks(matrix, by_row, by_col)
    finite = np.isfinite(blocks)
    count = finite.sum(-1)
    mean = _finite_mean(blocks)
    low = np.where(count > 0, np.where(finite, blocks, np.inf).min(-1), np.nan)
    high = np.where(count > 0, np.where(finite, blocks, -np.inf).max(-1), np.nan)
    r0 = np.arange(n_r) * by_row
    c0 = np.arange(n_c) * by_col
    r1 = np.minimum(r0 + by_row, rows) - 1
    c1 = np.minimum(c0 + by_col, cols) - 1
    grid_r, grid_c = np.meshgrid(np.arange(n_r), np.arange(n_c), indexing="ij")
    bin_r, bin_c = grid_r.ravel(), grid_c.ravel()
    frame = pd.DataFrame(
        {
            "x0": c0[bin_c] - 0.5,
            "x1": c1[bin_c] + 0.5,
            "y0": r0[bin_r] - 0.5,
            "y1": r1[bin_r] + 0.5,
            "row_from": [str(row_labels[i]) for i in r0[bin_r]],
            "row_to": [str(row_labels[i]) for i in r1[bin_r]],
            "col_from": [str(col_labels[i]) for i in c0[bin_c]],
            "col_to": [str(col_labels[i]) for i in c1[bin_c]],
            "mean": mean.ravel(),
            "min": low.ravel(),
            "max": high.ravel(),
            "cells": count.ravel(),
        }
    )
    if by_row * by_col <= LISTED_CELLS:
        # each cell's "label: value" once, then each bin's cells joined: the cells of a bin are a block of
        # the padded grid (row by row), its padding None
        labels: np.ndarray  # [R, C]
        if cell_labels is not None:
            labels = np.asarray(cell_labels, dtype=object)
        elif by_row == 1:  # the bin's one row is in its heading: each cell is its column
            labels = np.broadcast_to(np.array([str(c) for c in col_labels], dtype=object), (rows, cols))
        elif by_col == 1:  # … its one column: each cell is its row
            labels = np.broadcast_to(np.array([[str(r)] for r in row_labels], dtype=object), (rows, cols))
        else:
            labels = np.array([[f"{r}/{c}" for c in col_labels] for r in row_labels], dtype=object)
        texts = [
            f"{label}: {value_format.format(v)}"
            for label, v in zip(labels.ravel(), matrix.ravel().tolist(), strict=True)
        ]
        cells = np.full((n_r * by_row, n_c * by_col), None, dtype=object)
        cells[:rows, :cols] = np.array(texts, dtype=object).reshape(rows, cols)
        listed = cells.reshape(n_r, by_row, n_c, by_col).transpose(0, 2, 1, 3).reshape(n_r * n_c, -1)
        frame["values"] = [" · ".join(cell for cell in block if cell is not None) for block in listed]
    else:
        frame["values"] = ""
    return frame


def formatted(values: np.ndarray, spec: str) -> list[str]:
    """[N] each value in the format `spec` (Python's mini-language, which agrees with d3-format's for the
    "f", "g" and "%" specs the charts use), "" where it is not finite."""
    numbers = np.asarray(values, dtype=np.float64).tolist()  # Python floats format twice as fast
    return [format(v, spec) if math.isfinite(v) else "" for v in numbers]


def spans(first: pd.Series, last: pd.Series) -> list[str]:
    """[N] "first–last" of each pair of labels, the label alone where they are one."""
    return [a if a == b else f"{a}–{b}" for a, b in zip(first, last, strict=True)]


# ---- the chart -------------------------------------------------------------------------------------------
def raster_layers(
    matrix: np.ndarray,
    ramp: ColourRamp,
    *,
    x_scale: alt.Scale,
    y_scale: alt.Scale,
    x_axis: alt.Axis | None,
    y_axis: alt.Axis | None,
    row_title: str,
    col_title: str,
    value_title: str,
    row_labels: Sequence | None = None,
    col_labels: Sequence | None = None,
    legend: alt.Legend | None = None,
    overlay: bool = True,
    clip: bool = False,
    max_cells: int = OVERLAY_CELLS,
    value_format: str = ".4g",
    hover: np.ndarray | None = None,
    image_url: str | None = None,
    cell_labels: np.ndarray | None = None,
) -> list[alt.Chart]:
    """The image of `matrix` [R, C] (cell (r, c) spans column c ± 0.5 on `x_scale`, row r ± 0.5 on
    `y_scale`: give both domains [-0.5, n - 0.5], y reversed for row 0 at the top) and, with `overlay`, the
    transparent hover bins (`overlay_frame`) carrying the colour legend of `ramp`. `hover` [R, C]: the
    values the tooltips give when they are not the coloured ones (utilisation coloured by its log₂).
    `image_url`: the image already encoded (`png_data_url(matrix, ramp)`: one encoding for two views of a
    matrix). `cell_labels` [R, C]: what each cell's value is listed under in a bin's tooltip
    (`overlay_frame`). Each layer has its own data; layer them with any marks on the same scales (outlines,
    dots): the image carries the axes, layers over it name none (`over_axis`)."""
    rows, cols = np.asarray(matrix).shape
    image = pd.DataFrame(
        {
            "url": [image_url or png_data_url(matrix, ramp)],
            "x0": [-0.5],
            "x1": [cols - 0.5],
            "y0": [-0.5],
            "y1": [rows - 0.5],
        }
    )
    fy, fx = upscale_factors(rows, cols)
    smooth = rows * fy > MAX_IMAGE_PX or cols * fx > MAX_IMAGE_PX  # more cells than pixels: average them
    parts = [
        alt.Chart(image)
        .mark_image(aspect=False, smooth=smooth, clip=clip)
        .encode(
            x=alt.X("x0:Q", scale=x_scale, axis=x_axis),
            x2=alt.X2("x1"),
            y=alt.Y("y0:Q", scale=y_scale, axis=y_axis),
            y2=alt.Y2("y1"),
            url=alt.Url("url:N"),
        )
    ]
    if not overlay:
        return parts
    bins = overlay_frame(
        matrix if hover is None else hover,
        row_labels=row_labels,
        col_labels=col_labels,
        max_cells=max_cells,
        cell_labels=cell_labels,
    )
    shade = "mean" if hover is None else "shade"
    if hover is not None:
        bins["shade"] = binned_mean(matrix, max_cells)  # the colour's bins: not labelled or listed again
    single = bool((bins["cells"] <= 1).all()) and len(bins) == rows * cols
    # the tooltip's text made here, each range one field ("84–89", "0.01 – 0.3"), not per bin by the
    # browser: Vega builds each of thousands of tooltips, a conditional and a d3-format call per field,
    # through its slow CSP-safe expression interpreter on every draw
    bins["mean_text"] = formatted(bins["mean"].to_numpy(), value_format)
    bins["rows_text"] = spans(bins["row_from"], bins["row_to"])
    bins["cols_text"] = spans(bins["col_from"], bins["col_to"])
    if not single:
        low, high = (formatted(bins[column].to_numpy(), value_format) for column in ("min", "max"))
        bins["range_text"] = [f"{a} – {b}" if a != b else a for a, b in zip(low, high, strict=True)]
    said = {
        "rows_text": row_title,
        "cols_text": col_title,
        "mean_text": value_title if single else f"mean {value_title}",
        **({} if single else {"range_text": "range"}),
        **({"values": "each cell"} if bins["values"].str.len().gt(0).any() else {}),
    }
    tooltip = [alt.Tooltip(field=field, type="nominal", title=title) for field, title in said.items()]
    legend = legend or alt.Legend(title=value_title)
    legend["gradientOpacity"] = 1  # the overlay is transparent, its legend is not
    # the browser gets what the bins draw and say, no more: their labels and statistics as numbers and
    # text besides were a third of a drill-down's bytes
    shipped = ["x0", "x1", "y0", "y1", "mean", *([] if hover is None else ["shade"]), *said]
    parts.append(
        alt.Chart(bins[shipped])
        .mark_rect(opacity=0, clip=clip)
        .encode(
            x=alt.X("x0:Q", scale=x_scale, axis=over_axis(x_axis)),
            x2=alt.X2("x1"),
            y=alt.Y("y0:Q", scale=y_scale, axis=over_axis(y_axis)),
            y2=alt.Y2("y1"),
            color=alt.Color(f"{shade}:Q", scale=ramp.scale(), legend=legend),
            tooltip=tooltip,
        )
    )
    return parts


def over_axis(axis: alt.Axis | None) -> Any:
    """The axis argument of a layer drawn over one whose axis is `axis`: none where it has none, else
    unset — Vega-Lite merges the layers' axes of a shared scale, so the first layer's (with its tick and
    label expressions, kilobytes at hundreds of experts) is not shipped and parsed once per layer."""
    return None if axis is None else alt.Undefined


def position_axis(title: str, labels: Sequence | None = None) -> alt.Axis:
    """An axis over whole cell positions (Vega picks the ticks, none dropped), each labelled
    `labels[position]` when given (JSON string literals: any text is safe in the Vega expression)."""
    extra: dict[str, Any] = {}
    if labels is not None:
        items = ",".join(json.dumps(str(label)) for label in labels)
        whole = f"datum.value >= 0 && datum.value < {len(labels)} && datum.value % 1 == 0"
        extra["labelExpr"] = f"{whole} ? [{items}][datum.value] : ''"
    return alt.Axis(title=title, tickMinStep=1, labelOverlap=False, grid=False, **extra)


def cell_scales(rows: int, cols: int) -> tuple[alt.Scale, alt.Scale]:
    """(x, y) position scales whose cells are whole positions: x over columns [-0.5, cols - 0.5], y over
    rows [-0.5, rows - 0.5], row 0 at the top."""
    x = alt.Scale(domain=[-0.5, cols - 0.5], nice=False, zero=False)
    y = alt.Scale(domain=[-0.5, rows - 0.5], reverse=True, nice=False, zero=False)
    return x, y


def raster_heatmap(
    matrix: np.ndarray,
    ramp: ColourRamp,
    *,
    row_title: str,
    col_title: str,
    value_title: str,
    row_labels: Sequence | None = None,
    col_labels: Sequence | None = None,
    x_axis: alt.Axis | None = None,
    y_axis: alt.Axis | None = None,
    legend: alt.Legend | None = None,
    title: str | alt.Title | None = None,
    height: int = 400,
    autosize: Any = alt.Undefined,
    value_format: str = ".4g",
    hover: np.ndarray | None = None,
) -> alt.LayerChart:
    """A standalone raster heatmap of `matrix` [R, C]: rows down y (row 0 at the top), columns along x,
    quantitative position axes (default: Vega's ticks at whole positions, labelled by `row_labels` /
    `col_labels` when given), the hover overlay (of `hover` [R, C] when given) and the colour legend of
    `ramp`."""
    rows, cols = np.asarray(matrix).shape
    x_scale, y_scale = cell_scales(rows, cols)
    x_axis = x_axis or position_axis(col_title, col_labels)
    y_axis = y_axis or position_axis(row_title, row_labels)
    parts = raster_layers(
        matrix,
        ramp,
        x_scale=x_scale,
        y_scale=y_scale,
        x_axis=x_axis,
        y_axis=y_axis,
        row_title=row_title,
        col_title=col_title,
        value_title=value_title,
        row_labels=row_labels,
        col_labels=col_labels,
        legend=legend,
        value_format=value_format,
        hover=hover,
    )
    return layered_chart(
        *parts, height=height, autosize=autosize, title=alt.Undefined if title is None else title
    )
