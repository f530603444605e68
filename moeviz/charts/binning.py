"""Long inputs: bin token rows before they reach Vega-Lite, so a chart never ships more than a few tens of
thousands of marks, and totals survive the binning."""

from __future__ import annotations

import math
from collections.abc import Sequence

import altair as alt
import numpy as np
import pandas as pd

from moeviz.charts._common import FIT_WIDTH, spaced_ticks

MAX_BINS = 200
TOKEN_TICKS = 8  # the most token-axis ticks: 4-digit labels stay apart at ~400 px


def bin_size(num_rows: int, max_bins: int = MAX_BINS) -> int:
    """Rows per bin so that `num_rows` rows make at most `max_bins` bins (1 when they already fit)."""
    if max_bins < 1:
        raise ValueError(f"max_bins must be >= 1, got {max_bins}")
    return max(1, math.ceil(num_rows / max_bins))


def bin_rows(
    frame: pd.DataFrame,
    *,
    row: str = "row",
    keys: Sequence[str] = ("expert",),
    sums: Sequence[str] = (),
    means: Sequence[str] = (),
    max_bins: int = MAX_BINS,
) -> pd.DataFrame:
    """Aggregate consecutive token rows into at most `max_bins` equal bins, per `keys`.

    Input: any tidy frame with an integer token index column `row` (0..N-1), the `keys` columns and the
    numeric `sums`/`means` columns. Output: one row per (bin, *keys): bin, row_start, row_stop
    (inclusive), tokens (distinct rows in the bin), each `sums` column summed (so totals are kept exactly)
    and each `means` column averaged.
    """
    num_rows = int(frame[row].max()) + 1 if len(frame) else 0
    size = bin_size(num_rows, max_bins)
    binned = frame.assign(bin=frame[row].to_numpy() // size)
    agg: dict[str, tuple[str, str]] = {
        "row_start": (row, "min"),
        "row_stop": (row, "max"),
        "tokens": (row, "nunique"),
    }
    agg |= {col: (col, "sum") for col in sums}
    agg |= {col: (col, "mean") for col in means}
    return binned.groupby(["bin", *keys], sort=True).agg(**agg).reset_index()


def binned_dispatch_heatmap(
    scores_frame: pd.DataFrame, *, max_bins: int = MAX_BINS, title: str | None = None
) -> alt.Chart:
    """Token-bin × expert heatmap for long inputs: the share of each bin's tokens dispatched to an expert.

    Input: `Trace.scores_frame(layer, site)` (columns row, expert, score, dispatched). Colour =
    dispatched / tokens of the bin (mean over the bin of the 0/1 dispatch); tooltip adds the bin's token
    range, dispatch count and mean score. At most max_bins × experts cells.
    """
    frame = scores_frame[["row", "expert", "score"]].assign(
        dispatched=scores_frame["dispatched"].to_numpy(dtype=np.int64)
    )
    data = bin_rows(frame, sums=["dispatched"], means=["score"], max_bins=max_bins)
    data["dispatch_rate"] = data["dispatched"] / data["tokens"]
    num_rows = int(frame["row"].max()) + 1 if len(frame) else 0
    size = bin_size(num_rows, max_bins)
    num_experts = int(data["expert"].nunique()) if len(data) else 0
    return (
        alt.Chart(data)
        .mark_rect()
        .encode(
            # a plain position axis (a binned one ticks every bin edge: 50 labels smeared into one), its
            # ticks round token numbers ending on the input's length
            x=alt.X(
                "row_start:Q",
                title=f"token (bins of {size})",
                scale=alt.Scale(domain=[0, num_rows], nice=False, zero=True),
                axis=alt.Axis(
                    values=spaced_ticks(num_rows, TOKEN_TICKS), labelOverlap=False, labelFlush=True
                ),
            ),
            x2=alt.X2("row_end:Q"),
            y=alt.Y("expert:O"),
            color=alt.Color(
                "dispatch_rate:Q", scale=alt.Scale(scheme="blues", domain=[0, 1]), title="dispatched"
            ),
            tooltip=[
                alt.Tooltip("row_start:Q", title="from token"),
                alt.Tooltip("row_stop:Q", title="to token"),
                alt.Tooltip("expert:O"),
                alt.Tooltip("dispatched:Q", title="tokens dispatched"),
                alt.Tooltip("dispatch_rate:Q", format=".1%", title="share of bin"),
                alt.Tooltip("score:Q", format=".4f", title="mean score"),
            ],
        )
        .transform_calculate(row_end=f"min(datum.row_start + {size}, {num_rows})")  # the last bin: shorter
        .properties(
            title=alt.Title(
                title or "Dispatch over the whole input",
                subtitle=_bins_subtitle(frame, data, size, num_experts),
            ),
            height=min(max(18 * num_experts, 120), 640),
            autosize=FIT_WIDTH,
        )
    )


def _bins_subtitle(frame: pd.DataFrame, data: pd.DataFrame, size: int, num_experts: int) -> str:
    """What a binned dispatch heatmap shows, in words a reader can check against the axes (a cell count,
    "1650 cells", says nothing): the tokens, the bins they make, the experts and what a cell's colour is."""
    tokens = int(frame["row"].nunique()) if len(frame) else 0
    bins = int(data["bin"].nunique()) if len(data) else 0
    return (
        f"{tokens:,} tokens in {bins} bins of {size} · {num_experts} experts shown · colour = share of a "
        "bin's tokens sent to the expert"
    )
