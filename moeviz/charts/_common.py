"""Pieces several chart modules share: layer row labels and the log₂ fold-change colour of the heatmaps."""

from __future__ import annotations

import altair as alt
import numpy as np
import pandas as pd


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
        legend=alt.Legend(title=title, values=[-3, -1, 0, 1, 3]),
    )
