"""Axis ticks that reach the last expert and legends that fit their column, at spec level: `spaced_ticks`
over the expert counts of today's models and every axis length; the layer × expert heatmap's detail axis
(its ticks follow the overview's brush: the unbrushed list read from the spec, the brushed lists computed by
Node from the spec's own expression, each checked against what a tick list must be); and the Compare page's
half-column load heatmaps with their legend under the cells."""

from __future__ import annotations

import itertools
import json
import math
import re
import shutil
import subprocess

import altair as alt
import numpy as np
import pandas as pd
import pytest

from moeviz.analysis import expert_balance_frame
from moeviz.charts import layer_expert_heatmap
from moeviz.charts._common import spaced_ticks
from moeviz.charts.compare import side_by_side_load_heatmap
from moeviz.charts.scale import TICK_SPACING
from moeviz.testing.scale_traces import synthetic_trace

alt.data_transformers.disable_max_rows()

EXPERTS = [8, 16, 60, 64, 128, 256, 384]
AXIS_PX = [160, 200, 380, 700, 1000, 1400]  # a narrow column … a wide page


def check_ticks(ticks: list[int], lo: int, hi: int, max_ticks: int) -> None:
    """What a tick list over positions lo…hi must be: increasing integers inside the range, ending on hi,
    round (one step of 1, 2 or 5 × 10ⁿ, multiples of it) before the end, the one before the end at least half
    a step from it (labels never touch), and no more than `max_ticks` + 1 of them."""
    assert ticks, (lo, hi)
    assert ticks[-1] == hi, (ticks, hi)
    assert all(lo <= t <= hi and float(t).is_integer() for t in ticks), ticks
    assert all(b > a for a, b in itertools.pairwise(ticks)), ticks
    rounds = ticks[:-1]
    if len(rounds) >= 2:
        step = rounds[1] - rounds[0]
        assert step / 10 ** int(math.log10(step)) in (1, 2, 5), ticks
        assert all(t % step == 0 for t in rounds) and np.all(np.diff(rounds) == step), ticks
        assert hi - rounds[-1] >= step / 2, ticks
    assert len(ticks) <= max_ticks + 1, (len(ticks), max_ticks)


@pytest.mark.parametrize("experts", EXPERTS)
@pytest.mark.parametrize("axis_px", AXIS_PX)
def test_spaced_ticks_reach_the_last_expert_at_every_axis_length(experts: int, axis_px: int) -> None:
    max_ticks = max(axis_px // TICK_SPACING, 2)
    ticks = spaced_ticks(experts - 1, max_ticks)
    assert ticks[0] == 0
    check_ticks(ticks, 0, experts - 1, max_ticks)


def detail_values(spec: dict) -> list[dict]:
    """The `values` of every x axis of the heatmap's detail view (the second of its vconcat)."""
    found = []

    def walk(node):
        if isinstance(node, dict):
            axis = node.get("axis") if isinstance(node.get("axis"), dict) else None
            if axis and "values" in axis and "field" in node:
                found.append(axis["values"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(spec["vconcat"][1])
    return found


def small_trace(experts: int, layers: int, k: int):
    return synthetic_trace(
        num_experts=experts, k=k, n_group=1, topk_group=1, num_blocks=layers, first_dense=0, num_tokens=200
    )


def heatmap_spec(experts: int, width: int, layers: int = 6) -> dict:
    frame = expert_balance_frame(small_trace(experts, layers, k=4))
    return layer_expert_heatmap(frame, "utilisation", width=width).to_dict()


def unbrushed(expr: str) -> list[int]:
    """The literal list the expression gives while nothing is brushed (its last branch)."""
    literal = re.search(r":\s*(\[[0-9, ]+\])\s*$", expr)
    assert literal, expr
    return json.loads(literal.group(1))


@pytest.mark.parametrize("experts", [60, 64, 128, 256, 384])
@pytest.mark.parametrize("width", [380, 1000])
@pytest.mark.parametrize("layers", [6, 30])  # 30 × 256 cells and more: drawn as an image
def test_the_detail_axis_ends_on_the_last_expert_while_nothing_is_brushed(experts, width, layers) -> None:
    spec = heatmap_spec(experts, width, layers)
    values = detail_values(spec)
    assert values, "the detail's expert axis leaves its ticks to Vega (they stop at the last round number)"
    for value in values:
        ticks = unbrushed(value["expr"])
        check_ticks(ticks, 0, experts - 1, max(width // TICK_SPACING, 2))
        assert ticks == spaced_ticks(experts - 1, max(width // TICK_SPACING, 2))


NODE = shutil.which("node")
VEGA_FUNCTIONS = """
const isArray = Array.isArray, max = Math.max, min = Math.min, ceil = Math.ceil, floor = Math.floor,
  pow = Math.pow, log = Math.log, LN10 = Math.LN10;
const length = a => a.length, join = (a, s) => a.join(s), split = (t, s) => String(t).split(s);
function sequence(start, stop, step) {  // Vega's sequence (d3.range)
  const n = Math.max(0, Math.ceil((stop - start) / step)), out = new Array(n);
  for (let i = 0; i < n; ++i) out[i] = start + i * step;
  return out;
}
"""


def evaluate(expr: str, brushes: list[tuple[float, float] | None]) -> list[list[float]]:
    """The expression evaluated by Node with Vega's expression functions, for each brush extent
    (None: nothing brushed), as numbers (Vega's linear scale reads tick values as numbers)."""
    cases = json.dumps([None if b is None else {"x0": list(b)} for b in brushes])
    script = (
        VEGA_FUNCTIONS
        + f"const out = {cases}.map(experts => {{ experts = experts || {{}}; "
        + f"return ({expr}).map(Number); }});"
        + "console.log(JSON.stringify(out));"
    )
    assert NODE is not None, "needs Node (Debian's nodejs, which `make test` installs)"
    done = subprocess.run([NODE, "-e", script], capture_output=True, text=True, check=True, timeout=30)
    return json.loads(done.stdout)


@pytest.mark.parametrize("experts", [64, 256, 384])
@pytest.mark.parametrize("layers", [6, 30])
def test_the_detail_axis_ends_on_the_last_expert_shown_when_brushed(experts, layers) -> None:
    width = 700
    (value, *_) = detail_values(heatmap_spec(experts, width, layers))
    max_ticks = width // TICK_SPACING
    brushes = [None, (-0.5, experts - 0.5), (199.6, experts - 0.5), (10.2, 37.9), (3.4, 5.6), (100.0, 103.0)]
    brushes = [b for b in brushes if b is None or b[0] < b[1] <= experts]
    for brush, ticks in zip(brushes, evaluate(value["expr"], brushes), strict=True):
        lo, hi = (0, experts - 1) if brush is None else (math.ceil(brush[0]), math.floor(brush[1]))
        check_ticks([int(t) for t in ticks], lo, hi, max_ticks)
    narrow = evaluate(value["expr"], [(10.2, 10.4)])  # narrower than one expert: none shown
    assert narrow == [[]]


def test_compare_heatmaps_keep_their_legend_under_the_cells() -> None:
    trace = small_trace(8, 4, k=2)
    frame = expert_balance_frame(trace)
    spec = side_by_side_load_heatmap(frame, title="B: sample:mixtral-unbalanced").to_dict()
    legend = spec["encoding"]["color"]["legend"]
    # beside the cells the legend took ~100 px of a ~330 px column and was cut at the right and bottom
    assert legend["orient"] == "bottom" and legend["direction"] == "horizontal"
    half_column_at_900_px = 200
    assert legend["gradientLength"] <= half_column_at_900_px
    assert legend["labelOverlap"] is False and legend["values"] == [-3, -1, 0, 1, 3]  # all five labels
    assert legend["titleLimit"] >= 7 * len(legend["title"])  # ~7 px a character at 11 px: never cut
    # the cells are the library's load heatmap's
    data = pd.DataFrame(next(iter(spec["datasets"].values())))
    np.testing.assert_allclose(
        data.sort_values(["layer", "expert"])["utilisation"],
        frame.sort_values(["layer", "expert"])["utilisation"],
    )
