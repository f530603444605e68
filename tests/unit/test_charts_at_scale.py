"""Charts at 58 layers and 256 experts, at spec level on DeepSeek-V3-shaped synthetic
traces: the dispatch overview's token axis, layer axes that never overlap, expert axes that end on the
last expert, every slot in the slot legend, attention maps on a log or per-row scale, paths over a window
of layers, and the verdict summary of the Load page."""

from __future__ import annotations

import math
from collections import Counter

import altair as alt
import numpy as np
import pandas as pd
import pytest

from moeviz.analysis import (
    collapse_report,
    expert_balance_frame,
    path_frame,
    repetition_frame,
    token_confidence_frame,
    token_scores_frame,
)
from moeviz.analysis.collapse import NOT_ENOUGH_TOKENS, summarise_report
from moeviz.analysis.structure import default_path_length, path_layer_ids, path_window
from moeviz.charts import (
    attention_map_chart,
    binned_dispatch_heatmap,
    layer_expert_heatmap,
    repetition_chart,
    token_margin_chart,
    token_rank_path_chart,
)
from moeviz.charts._common import spaced_ticks
from moeviz.charts.attention import LOG_FLOOR
from moeviz.charts.scale import HEATMAP_WIDTH
from moeviz.testing.scale_traces import synthetic_trace
from tests.support.charts import data_of

alt.data_transformers.disable_max_rows()


@pytest.fixture(scope="module")
def trace():
    """256 experts, top-8 from 4 of 8 groups, 58 MoE layers (3 … 60), 300 tokens."""
    return synthetic_trace(num_tokens=300)


def layered_encodings(spec: dict) -> list[dict]:
    """The encodings of a spec's views (a single view, or each layer)."""
    return [view["encoding"] for view in spec.get("layer", [spec]) if "encoding" in view]


# ---- tick values -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("last", "max_ticks"), [(255, 17), (255, 10), (383, 15), (1032, 8), (57, 8), (7, 8)])
def test_spaced_ticks_are_round_end_on_the_last_value_and_stay_apart(last, max_ticks):
    ticks = spaced_ticks(last, max_ticks)
    assert ticks[0] == 0 and ticks[-1] == last
    gaps = np.diff(ticks)
    step = int(gaps[0])
    assert step / 10 ** int(math.log10(step)) in (1, 2, 5)  # 1, 2 or 5 × 10ⁿ
    assert (gaps[:-1] == step).all() and gaps[-1] >= step / 2  # the tick before the last kept apart
    assert len(ticks) <= max_ticks + 1


# ---- the dispatch overview -------------------------------------------------------------------------------
def test_dispatch_overview_ticks_round_token_numbers_not_every_bin_edge(trace):
    routing = trace.layers[0]
    frame = trace.scores_frame(routing.layer, routing.site)
    frame = frame[frame["expert"] < 32]
    spec = binned_dispatch_heatmap(frame, max_bins=50).to_dict()
    x = spec["encoding"]["x"]
    num_tokens = frame["row"].max() + 1
    assert "bin" not in x  # a binned axis ticks every bin edge: 50 labels smeared into one
    assert x["scale"]["domain"] == [0, num_tokens]
    values = x["axis"]["values"]
    assert values[0] == 0 and values[-1] == num_tokens and len(values) <= 9
    assert x["axis"]["labelFlush"] is True
    # the bins still tile [0, N]: the last one is cut at N
    (calc,) = [t for t in spec["transform"] if "calculate" in t]
    assert calc["calculate"].endswith(f", {num_tokens})")


# ---- layer axes at 58 layers -----------------------------------------------------------------------------
def assert_layer_labels_never_touch(axis: dict, layers: list[int], width: int, label_px: int) -> None:
    """No label dropped by Vega (labelOverlap off) and, at `width` px, labelled layers at least `label_px`
    apart: every layer when they fit, else every n-th from the first, ending on the last."""
    assert axis["labelOverlap"] is False
    shown = axis.get("values", layers)
    assert set(shown) <= set(layers) and shown[0] == layers[0] and shown[-1] == layers[-1]
    band = width / len(layers)
    gaps = np.diff([layers.index(v) for v in shown])
    assert gaps.min() * band >= label_px, (gaps.min(), band)


def test_repetition_chart_layer_labels_never_touch(trace):
    repetition = repetition_frame(trace)
    layers = sorted(repetition["layer"].unique().tolist())
    assert len(layers) == 58
    axis = repetition_chart(repetition).to_dict()["encoding"]["x"]["axis"]
    assert axis["labelAngle"] == 0 and len(axis["values"]) < 58
    assert_layer_labels_never_touch(axis, layers, 600, 18)  # upright two-digit labels at 600 px
    few = repetition[repetition["layer"] < 7]  # 4 layers: every label
    axis = repetition_chart(few).to_dict()["encoding"]["x"]["axis"]
    assert "values" not in axis and axis["labelOverlap"] is False


def test_margin_chart_layer_labels_never_touch_in_a_half_column(trace):
    confidence = token_confidence_frame(trace, 0, 3)
    layers = sorted(confidence["layer"].unique().tolist())
    spec = token_margin_chart(confidence).to_dict()
    axis = spec["encoding"]["x"]["axis"]
    assert axis["labelAngle"] == -90 and len(axis["values"]) < 58
    assert_layer_labels_never_touch(axis, layers, 380, 12)  # turned labels, 10 px font, a half column
    assert sorted(data_of(spec)["layer"]) == layers  # every layer still drawn


# ---- expert axes at 256 experts --------------------------------------------------------------------------
def heatmap_views(spec: dict) -> tuple[dict, dict]:
    """The overview's cell layer and the detail's cell layer of `layer_expert_heatmap` at scale."""
    overview, detail = spec["vconcat"]
    return overview["layer"][0], detail["layer"][0]


@pytest.mark.parametrize("order", [None, "load"])
def test_load_heatmap_expert_axis_ends_on_the_last_expert_and_fits_the_page(trace, order):
    frame = expert_balance_frame(trace)
    ids = (
        list(range(256))
        if order is None
        else frame.groupby("expert")["count"].sum().sort_values(ascending=False, kind="stable").index.tolist()
    )
    spec = layer_expert_heatmap(
        frame,
        "utilisation",
        order=None if order is None else ids,
        raster=False,  # the per-cell legend
    ).to_dict()
    overview, detail = heatmap_views(spec)
    axis = overview["encoding"]["x"]["axis"]
    values = axis["values"]
    assert values[0] == 0 and values[-1] == len(ids) - 1  # positions: the first and the last expert
    assert np.diff(values).min() * HEATMAP_WIDTH / len(ids) >= 20  # three-digit labels apart at this width
    assert axis["labelFlush"] is True and detail["encoding"]["x"]["axis"]["labelFlush"] is True
    if order is not None:  # each position labelled with the id at it: the last one is the quietest expert
        assert f"[{','.join(str(i) for i in ids)}][datum.value]" in axis["labelExpr"]
    # the legend above the charts, not beside them: the concatenation keeps its fixed width
    assert overview["encoding"]["color"]["legend"]["orient"] == "top"
    assert spec["vconcat"][0]["width"] == spec["vconcat"][1]["width"] == HEATMAP_WIDTH <= 720


# ---- the slot legend -------------------------------------------------------------------------------------
@pytest.mark.parametrize("rank_by", ["score", "load"])
def test_slot_legend_lists_every_one_of_the_k_slots(trace, rank_by):
    mine = token_scores_frame(trace, 0, 7)
    k = int(mine[mine["dispatched"]].groupby("layer").size().max())
    assert k == 8
    spec = token_rank_path_chart(mine, rank_by=rank_by, load=expert_balance_frame(trace)).to_dict()
    (colour,) = [e["color"] for e in layered_encodings(spec) if e.get("color", {}).get("field") == "slot"]
    legend = colour["legend"]
    assert legend["values"] == list(range(k))
    assert legend.get("columns", k) >= k or legend.get("direction") == "horizontal"


# ---- attention map at a thousand keys --------------------------------------------------------------------
def attention_cells(num_keys: int, seed: int = 0) -> pd.DataFrame:
    """A causal attention block over the last 8 queries of a `num_keys`-token text, every row summing to 1
    over all keys (so ~1/num_keys each), as `attention_block_frame` gives it."""
    rng = np.random.default_rng(seed)
    queries = np.arange(num_keys - 8, num_keys)
    keys = np.arange(num_keys)
    logits = rng.normal(size=(len(queries), num_keys))
    logits[keys[None, :] > queries[:, None]] = -np.inf
    weights = np.exp(logits - logits.max(axis=1, keepdims=True))
    weights /= weights.sum(axis=1, keepdims=True)
    q, k = np.meshgrid(queries, keys, indexing="ij")
    return pd.DataFrame(
        {
            "query_pos": q.ravel(),
            "key_pos": k.ravel(),
            "query": [f"{p}:q" for p in q.ravel()],
            "key": [f"{p}:k" for p in k.ravel()],
            "weight": weights.ravel(),
        }
    )


def test_attention_map_on_a_log_scale_tells_weights_of_a_thousand_keys_apart():
    cells = attention_cells(1000)
    assert cells["weight"].max() < 0.02  # all ~1/1000: one flat grey on a 0–1 scale
    spec = attention_map_chart(cells, scale="log").to_dict()
    colour = spec["encoding"]["color"]
    assert colour["field"] == "shade" and colour["scale"]["type"] == "log"
    assert colour["scale"]["domain"] == [LOG_FLOOR, 1]
    shown = data_of(spec)
    np.testing.assert_allclose(shown["shade"], np.clip(cells["weight"], LOG_FLOOR, 1))
    np.testing.assert_allclose(shown["weight"], cells["weight"])  # the tooltip keeps the weight itself
    assert "log₁₀ p" in spec["title"]["subtitle"]


def test_attention_map_per_row_scale_divides_by_the_rows_largest_weight():
    cells = attention_cells(1000, seed=1)
    spec = attention_map_chart(cells, scale="row").to_dict()
    shown = data_of(spec)
    block = cells["weight"].to_numpy().reshape(8, 1000)
    np.testing.assert_allclose(shown["shade"].to_numpy().reshape(8, 1000), block / block.max(axis=1)[:, None])
    colour = spec["encoding"]["color"]
    assert colour["field"] == "shade" and colour["scale"]["domain"] == [0, 1]
    assert colour["legend"]["title"] == "p ÷ row max"
    with pytest.raises(ValueError, match="scale must be one of"):
        attention_map_chart(cells, scale="sqrt")


# ---- expert paths over a window of layers ----------------------------------------------------------------
def test_paths_over_a_window_of_layers_repeat_where_58_hop_paths_do_not(trace):
    whole = path_frame(trace, top_n=5, site="mlp")
    assert whole["count"].max() == 1 and whole["label"].str.count("→").max() == 57  # each 58-hop path once
    chain = path_layer_ids(trace, "mlp")
    assert default_path_length(len(chain), 256) == 2 and default_path_length(4, 8) == 4
    window = path_window(chain, 20, 2)
    assert window == [20, 21]
    assert path_window(chain, 60, 3) == [58, 59, 60]  # from the last layer: moved back to fit
    paths = path_frame(trace, top_n=15, layers=window, site="mlp")
    top1 = {r.layer: r.experts[:, 0] for r in trace.layers}
    counted = Counter(f"{a}→{b}" for a, b in zip(top1[20].tolist(), top1[21].tolist(), strict=True))
    assert paths["count"].tolist() == [n for _, n in counted.most_common(len(paths))]
    assert all(counted[label] == n for label, n in zip(paths["label"], paths["count"], strict=True))
    assert paths["count"].iloc[0] > 1 and paths["label"].str.count("→").eq(1).all()


# ---- the verdict summary ---------------------------------------------------------------------------------
def test_verdict_summary_counts_layers_by_verdict_and_by_kind_of_note():
    long = synthetic_trace(num_tokens=1024, skew=2.0, seed=3)
    report = collapse_report(long)
    summary = summarise_report(report)
    verdicts = Counter(str(lv.verdict) for lv in report.layers)
    assert summary.layers == 58 and sum(summary.by_verdict.values()) == 58
    assert summary.by_verdict == {name: verdicts.get(name, 0) for name in ("healthy", "warning", "collapsed")}
    assert {lv.layer for lv in summary.flagged} == {lv.layer for lv in report.layers if lv.reasons}
    significant = {lv.layer for lv in report.layers if any(n.startswith("not significant") for n in lv.notes)}
    too_few = {lv.layer for lv in report.layers if any(n.startswith(NOT_ENOUGH_TOKENS) for n in lv.notes)}
    assert {lv.layer for lv in summary.noted.get("not significant", ())} == significant
    assert {lv.layer for lv in summary.noted.get(NOT_ENOUGH_TOKENS, ())} == too_few
    assert significant or too_few  # the case the summary is for: notes on many layers
    head = summary.headline()
    assert head.startswith("58 MoE layers: ")
    for name, n in verdicts.items():
        assert f"{n} {name}" in head
    notes = summary.notes_line()
    if significant:
        assert f"{len(significant)} layers not significant" in notes or f"{len(significant)} layer " in notes
