"""What the Routing page's charts at scale leave the browser to do (its Vega runs expressions through a slow
CSP-safe interpreter, per mark and per row): the load curve draws its fair share as one rule, not one per
expert; a raster's hover bins carry their tooltip numbers formatted (checked against the bins' means taken
here from the matrix); one token's rank path ships its cell edges instead of computing them per row. Charts
are rendered by Vega itself (vl-convert) where what is drawn is the point."""

from __future__ import annotations

import json
import re

import altair as alt
import numpy as np
import pandas as pd
import vl_convert as vlc

from moeviz.analysis.scale_frames import token_scores_frame
from moeviz.charts.raster import ColourRamp, raster_layers
from moeviz.charts.scale import expert_load_curve_chart, token_rank_path_chart
from moeviz.testing.scale_traces import shaped_trace


def mark_group(svg: str, mark: str, name: str) -> str:
    """The markup of the mark group `<mark> role-mark <name>` of a rendered SVG."""
    match = re.search(rf'<g class="mark-{mark} role-mark {name}"[^>]*>(.*?)</g>', svg, re.S)
    assert match, (mark, name)
    return match.group(1)


def test_the_load_curve_draws_one_fair_share_rule() -> None:
    counts = np.random.default_rng(0).integers(0, 50, 256)
    chart = expert_load_curve_chart(pd.DataFrame({"expert": np.arange(256), "count": counts}), highlight=3)
    svg = vlc.vegalite_to_svg(chart.to_dict())
    rules = re.findall(r'<g class="mark-rule role-mark [^"]*"[^>]*>(.*?)</g>', svg, re.S)
    assert [group.count("<line") for group in rules] == [1]  # one dashed line, not one per expert
    points = sum(
        group.count("<path") for group in re.findall(r'class="mark-symbol[^"]*"[^>]*>(.*?)</g>', svg)
    )
    assert points == 256 + 1  # every expert, and the chosen one's ring


def bin_means(matrix: np.ndarray, bins: pd.DataFrame) -> list[float]:
    """Each hover bin's mean over the finite cells its edges (x0..x1, y0..y1 at cell edges) enclose."""
    means = []
    for x0, x1, y0, y1 in bins[["x0", "x1", "y0", "y1"]].itertuples(index=False):
        block = matrix[int(y0 + 0.5) : int(y1 + 0.5), int(x0 + 0.5) : int(x1 + 0.5)]
        means.append(float(np.nanmean(block)) if np.isfinite(block).any() else float("nan"))
    return means


def test_a_rasters_hover_bins_carry_their_tooltip_numbers_formatted() -> None:
    matrix = np.random.default_rng(1).random((58, 256))
    matrix[3, 7] = np.nan
    scale = alt.Scale(domain=[-0.5, 255.5], nice=False, zero=False)
    rows = alt.Scale(domain=[-0.5, 57.5], reverse=True, nice=False, zero=False)
    _, overlay = raster_layers(
        matrix, ColourRamp.of("viridis", (0, 1)), x_scale=scale, y_scale=rows, x_axis=None, y_axis=None,
        row_title="layer", col_title="expert", value_title="score", value_format=".3f",
    )  # fmt: skip
    spec = overlay.to_dict()
    tooltip = spec["encoding"]["tooltip"]
    assert not [t for t in tooltip if "format" in t]  # nothing left for the browser to format per bin
    bins = pd.DataFrame(next(iter(spec["datasets"].values())))
    shown = {t["title"]: t["field"] for t in tooltip}
    expected = [format(m, ".3f") for m in bin_means(matrix, bins)]
    assert bins[shown["mean score"]].tolist() == expected
    assert 1 < len(bins) < matrix.size  # binned: several cells a bin
    # each range one field: the cells a bin covers, from its edges; its lowest and highest value
    first, last = (bins["x0"] + 0.5).astype(int), (bins["x1"] - 0.5).astype(int)
    want = [str(a) if a == b else f"{a}–{b}" for a, b in zip(first, last, strict=True)]
    assert bins[shown["expert"]].tolist() == want
    block = matrix[int(bins.loc[0, "y0"] + 0.5), first[0] : last[0] + 1]
    assert bins.loc[0, shown["range"]] == f"{np.nanmin(block):.3f} – {np.nanmax(block):.3f}"
    assert len(tooltip) == 5  # layer, experts, mean, range, each cell


def test_one_tokens_rank_path_ships_its_cell_edges() -> None:
    trace = shaped_trace("deepseek_v3", num_tokens=16)
    chart = token_rank_path_chart(token_scores_frame(trace, 0, 5), rank_by="score")
    spec = chart.to_dict()
    assert "calculate" not in json.dumps(spec)  # no expression per row left to the browser
    cells = pd.DataFrame(next(iter(spec["datasets"].values())))
    svg = vlc.vegalite_to_svg({**spec, "width": 580})
    rects = re.findall(
        r'd="M([-\d.]+),([-\d.]+)h([-\d.]+)v([-\d.]+)h', mark_group(svg, "rect", r"layer_0_marks")
    )
    assert len(rects) == len(cells)
    (width,) = {round(float(w), 3) for _, _, w, _ in rects}
    starts = np.unique([round(float(x), 3) for x, _, _, _ in rects])
    assert len(starts) == cells["row"].nunique()
    assert np.allclose(np.diff(starts), width, atol=0.01)  # each cell one layer wide, side by side
