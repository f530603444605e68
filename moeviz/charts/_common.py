"""Pieces several chart modules share: layer row labels, the log₂ fold-change colour of the heatmaps and the
two theme colours (INK, PAPER), the fit-to-width autosize (FIT_WIDTH)."""

from __future__ import annotations

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
