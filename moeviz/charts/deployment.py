"""Deployment what-if views (`moeviz.whatif`): expert parallelism, offloading caches, capacity drops,
quantisation flips and model sizes. Each function takes one of the result frames and draws it; no numbers
are derived here beyond reshaping (a chart's data are the frame's values)."""

from __future__ import annotations

import altair as alt
import numpy as np
import pandas as pd

from moeviz.charts._common import FIT_WIDTH, INK, PAPER, layered_chart, log2_fold, log2_fold_colour
from moeviz.charts.scale import MAX_CATEGORICAL, layer_expert_heatmap

# Dispatch messages by where they go (DeepEP's split): own GPU, same node over NVLink, other node over RDMA.
DISPATCH_KINDS = {
    "dispatch_bytes_local": "local (own GPU)",
    "dispatch_bytes_intra": "intra-node (NVLink)",
    "dispatch_bytes_inter": "inter-node (RDMA)",
}
_KIND_COLOURS = ["#9ecae9", "#4c78a8", "#e4572e"]
# Offloading policies in legend order; Belady (the optimum) is drawn dashed, as the ceiling.
POLICY_ORDER = ["belady", "lru", "lfu"]
_POLICY_COLOURS = ["#888888", "#4c78a8", "#f58518"]


def _layer_axis(title: str = "MoE layer") -> alt.X:
    return alt.X("layer:O", title=title, axis=alt.Axis(labelAngle=0))


def _rate_scale(rates: pd.Series) -> alt.Scale:
    """A rate axis from 0 that stays readable when every rate is 0 (at least 0 to 1%)."""
    peak = float(np.nanmax(rates.to_numpy(dtype=np.float64))) if len(rates) else 0.0
    return alt.Scale(domain=[0, max(peak if np.isfinite(peak) else 0.0, 0.01)])


def gpu_load_heatmap(gpu_load: pd.DataFrame, *, title: str = "Load per layer and GPU") -> alt.Chart:
    """Layer × GPU heatmap of the (token, expert) assignments each GPU serves, coloured by load ÷ the layer's
    mean GPU load (white = even, red = over, blue = under; log₂, clipped at 8×).

    Input: `EPResult.gpu_load_frame()` (columns layer, gpu, load).
    """
    data = gpu_load[["layer", "gpu", "load"]].copy()
    data["load"] = data["load"].astype(np.float64)
    mean = data.groupby("layer")["load"].transform("mean")
    data["relative"] = np.where(mean > 0, data["load"] / mean.where(mean > 0, 1.0), 1.0)
    data["log2_relative"] = log2_fold(data["relative"])
    layers = int(data["layer"].nunique()) if len(data) else 1
    return (
        alt.Chart(data)
        .mark_rect(stroke=PAPER, strokeWidth=0.5)
        .encode(
            x=alt.X("gpu:O", title="GPU", axis=alt.Axis(labelAngle=0)),
            y=alt.Y("layer:O", title="MoE layer"),
            color=log2_fold_colour("log2_relative", "log₂ load ÷ mean"),
            tooltip=[
                alt.Tooltip("layer:O"),
                alt.Tooltip("gpu:O", title="GPU"),
                alt.Tooltip("load:Q", format=",.0f", title="assignments"),
                alt.Tooltip("relative:Q", format=".2f", title="÷ layer mean"),
            ],
        )
        .properties(
            title=alt.Title(title, subtitle="white = the layer's mean GPU load, red = over, blue = under"),
            height=min(max(26 * layers, 190), 700),  # room for the colour legend's full length
            autosize=FIT_WIDTH,
        )
    )


def balancedness_chart(layers: pd.DataFrame, *, title: str = "ep_balancedness per layer") -> alt.Chart:
    """Bars of ep_balancedness b = mean ÷ max GPU load per layer (1 = perfectly even), grouped by placement
    when the frame has a `placement` column (several `EPResult.layers_frame()` stacked).

    Input: `EPResult.layers_frame()` (columns layer, ep_balancedness, max_gpu_load, mean_gpu_load, …).
    """
    columns = ["layer", "ep_balancedness", "max_gpu_load", "mean_gpu_load"]
    data = layers[columns + (["placement"] if "placement" in layers else [])].copy()
    if "placement" not in data:
        data["placement"] = ""
    placements = list(dict.fromkeys(data["placement"]))
    grouped = len(placements) > 1
    encoding = {
        "x": _layer_axis(),
        "y": alt.Y("ep_balancedness:Q", title="b = mean ÷ max GPU load", scale=alt.Scale(domain=[0, 1])),
        "tooltip": [
            alt.Tooltip("layer:O"),
            alt.Tooltip("placement:N"),
            alt.Tooltip("ep_balancedness:Q", format=".3f"),
            alt.Tooltip("max_gpu_load:Q", format=",.0f", title="max GPU load"),
            alt.Tooltip("mean_gpu_load:Q", format=",.1f", title="mean GPU load"),
        ],
    }
    if grouped:
        encoding["color"] = alt.Color(
            "placement:N", scale=alt.Scale(domain=placements), legend=alt.Legend(orient="bottom")
        )
        encoding["xOffset"] = alt.XOffset("placement:N", scale=alt.Scale(domain=placements))
    colour = alt.Undefined if grouped else "#4c78a8"
    return (
        alt.Chart(data)
        .mark_bar(color=colour)
        .encode(**encoding)
        .properties(
            title=alt.Title(title, subtitle="1 = every GPU serves the same load (SGLang/vLLM definition)"),
            height=200,
            autosize=FIT_WIDTH,
        )
    )


def dispatch_bytes_frame(layers: pd.DataFrame) -> pd.DataFrame:
    """Long form of the dispatch bytes per layer: columns layer, kind (DISPATCH_KINDS' labels), bytes,
    nodedup (the layer's remote bytes without dedup, repeated), stack (the stacking order: inter-node at
    the bottom, local on top, so the no-dedup tick compares with the top of the remote bytes)."""
    data = layers[["layer", *DISPATCH_KINDS, "dispatch_bytes_nodedup"]]
    long = data.melt(
        id_vars=["layer", "dispatch_bytes_nodedup"],
        value_vars=list(DISPATCH_KINDS),
        var_name="kind",
        value_name="bytes",
    )
    long["stack"] = long["kind"].map(
        {kind: -i for i, kind in enumerate(DISPATCH_KINDS)}
    )  # inter at the bottom
    long["kind"] = long["kind"].map(DISPATCH_KINDS)
    long["bytes"] = long["bytes"].astype(np.float64)
    return long.rename(columns={"dispatch_bytes_nodedup": "nodedup"})


def dispatch_bytes_chart(layers: pd.DataFrame, *, title: str = "Dispatch bytes per layer") -> alt.LayerChart:
    """Stacked bars of each layer's dispatch bytes, local / intra-node / inter-node (a token sent once per
    destination GPU, DeepEP's rule), with a tick at the no-dedup bytes (one message per remote (token,
    expert)). Combine bytes equal dispatch bytes and are not drawn again.

    Input: `EPResult.layers_frame()` (columns layer, dispatch_bytes_local, dispatch_bytes_intra,
    dispatch_bytes_inter, dispatch_bytes_nodedup, …).
    """
    data = dispatch_bytes_frame(layers)
    kinds = list(DISPATCH_KINDS.values())
    x = _layer_axis()
    bars = (
        alt.Chart()
        .mark_bar()
        .encode(
            x=x,
            y=alt.Y("bytes:Q", title="bytes", stack="zero"),
            color=alt.Color(
                "kind:N",
                scale=alt.Scale(domain=kinds, range=_KIND_COLOURS),
                sort=kinds,
                legend=alt.Legend(orient="bottom", title=None),
            ),
            order=alt.Order("stack:Q"),
            tooltip=[
                alt.Tooltip("layer:O"),
                alt.Tooltip("kind:N"),
                alt.Tooltip("bytes:Q", format=",.0f"),
            ],
        )
    )
    nodedup = (
        alt.Chart()
        .mark_tick(color=INK, thickness=2, strokeDash=[4, 2], size=30)
        .encode(
            x=x,
            y=alt.Y("max(nodedup):Q"),
            tooltip=[
                alt.Tooltip("layer:O"),
                alt.Tooltip("max(nodedup):Q", format=",.0f", title="no-dedup bytes"),
            ],
        )
    )
    return layered_chart(
        bars,
        nodedup,
        data=data,
        title=alt.Title(
            title,
            subtitle="stacked: inter-node / intra-node / local; dashed tick = remote bytes without dedup",
        ),
        height=220,
        autosize=FIT_WIDTH,
    )


def comm_share_chart(layers: pd.DataFrame, *, title: str = "All-to-All time vs expert compute") -> alt.Chart:
    """Per layer, horizontal stacked bars of the modelled All-to-All time (dispatch + combine) next to the
    experts' compute time; the tooltip gives communication's share of the MoE layer time.

    Input: `EPResult.layers_frame()` (columns layer, a2a_time_s, compute_time_s, comm_share, …).
    """
    data = layers[["layer", "a2a_time_s", "compute_time_s", "comm_share"]].melt(
        id_vars=["layer", "comm_share"],
        value_vars=["a2a_time_s", "compute_time_s"],
        var_name="part",
        value_name="seconds",
    )
    data["part"] = data["part"].map({"a2a_time_s": "All-to-All", "compute_time_s": "expert compute"})
    data["microseconds"] = data["seconds"].astype(np.float64) * 1e6
    parts = ["All-to-All", "expert compute"]
    layers_n = int(data["layer"].nunique()) if len(data) else 1
    return (
        alt.Chart(data)
        .mark_bar()
        .encode(
            y=alt.Y("layer:O", title="MoE layer"),
            x=alt.X(
                "microseconds:Q", title="modelled time (µs)", stack="zero", axis=alt.Axis(labelOverlap=True)
            ),
            color=alt.Color(
                "part:N",
                scale=alt.Scale(domain=parts, range=["#e4572e", "#4c78a8"]),
                legend=alt.Legend(orient="bottom", title=None),
            ),
            tooltip=[
                alt.Tooltip("layer:O"),
                alt.Tooltip("part:N"),
                alt.Tooltip("microseconds:Q", format=",.2f", title="µs"),
                alt.Tooltip("comm_share:Q", format=".1%", title="communication share"),
            ],
        )
        .properties(
            title=alt.Title(title, subtitle="communication's share of the MoE layer time in the tooltip"),
            height=min(max(24 * layers_n, 100), 700),
            autosize=FIT_WIDTH,
        )
    )


def hit_rate_curve_chart(curve: pd.DataFrame, *, title: str = "Hit rate vs cache size") -> alt.Chart:
    """Hit rate against the cache size C (experts per layer on the GPU), one line per policy; Belady's
    optimum is drawn dashed and grey: the ceiling no policy can pass.

    Input: `moeviz.whatif.offload.hit_rate_curve(...)` (columns policy, cache, hit_rate).
    """
    data = curve[["policy", "cache", "hit_rate"]].copy()
    data["hit_rate"] = data["hit_rate"].astype(np.float64)
    policies = [p for p in POLICY_ORDER if p in set(data["policy"])] + sorted(
        set(data["policy"]) - set(POLICY_ORDER)
    )
    colours = [_POLICY_COLOURS[POLICY_ORDER.index(p)] if p in POLICY_ORDER else "#54a24b" for p in policies]
    return (
        alt.Chart(data)
        .mark_line(point=True)
        .encode(
            x=alt.X(
                "cache:Q",
                title="cache size C (experts per layer on the GPU)",
                axis=alt.Axis(tickMinStep=1, labelOverlap=True),
            ),
            y=alt.Y(
                "hit_rate:Q", title="hit rate", scale=alt.Scale(domain=[0, 1]), axis=alt.Axis(format="%")
            ),
            color=alt.Color(
                "policy:N",
                scale=alt.Scale(domain=policies, range=colours),
                legend=alt.Legend(orient="bottom"),
            ),
            strokeDash=alt.StrokeDash(
                "policy:N",
                scale=alt.Scale(
                    domain=policies, range=[[6, 3] if p == "belady" else [1, 0] for p in policies]
                ),
                legend=None,
            ),
            tooltip=[
                alt.Tooltip("policy:N"),
                alt.Tooltip("cache:Q", title="C"),
                alt.Tooltip("hit_rate:Q", format=".1%", title="hit rate"),
            ],
        )
        .properties(
            title=alt.Title(title, subtitle="dashed grey = Belady (the optimum, the ceiling)"),
            height=240,
            autosize=FIT_WIDTH,
        )
    )


def cumulative_bytes_chart(steps: pd.DataFrame, *, title: str = "Bytes moved over decode steps") -> alt.Chart:
    """Cumulative bytes copied to the GPU (all layers) against the decode step, one line per policy when the
    frame has a `policy` column (several `OffloadResult.steps_frame()` stacked).

    Input: `OffloadResult.steps_frame()` (columns step, cumulative_bytes).
    """
    data = steps[["step", "cumulative_bytes"] + (["policy"] if "policy" in steps else [])].copy()
    data["cumulative_bytes"] = data["cumulative_bytes"].astype(np.float64)
    if "policy" not in data:
        data["policy"] = ""
    policies = [p for p in POLICY_ORDER if p in set(data["policy"])] + sorted(
        set(data["policy"]) - set(POLICY_ORDER)
    )
    colours = [_POLICY_COLOURS[POLICY_ORDER.index(p)] if p in POLICY_ORDER else "#54a24b" for p in policies]
    return (
        alt.Chart(data)
        .mark_line()
        .encode(
            x=alt.X("step:Q", title="decode step", axis=alt.Axis(labelOverlap=True)),
            y=alt.Y("cumulative_bytes:Q", title="cumulative bytes"),
            color=alt.Color(
                "policy:N",
                scale=alt.Scale(domain=policies, range=colours),
                legend=alt.Legend(orient="bottom"),
            ),
            tooltip=[
                alt.Tooltip("policy:N"),
                alt.Tooltip("step:Q"),
                alt.Tooltip("cumulative_bytes:Q", format=",.0f", title="bytes so far"),
            ],
        )
        .properties(title=title, height=220, autosize=FIT_WIDTH)
    )


def prefetch_recall_chart(recall: pd.DataFrame, *, title: str = "Speculative prefetch recall") -> alt.Chart:
    """Bars of the recall of predicting layer ℓ+1's experts by applying its router to layer ℓ's hidden state
    (1 = every expert predicted), per predicted layer.

    Input: `moeviz.whatif.prefetch.prefetch_recall(...)` (columns layer, from_layer, recall, tokens).
    """
    data = recall[["layer", "from_layer", "recall", "tokens"]].copy()
    data["recall"] = data["recall"].astype(np.float64)
    return (
        alt.Chart(data)
        .mark_bar(color="#4c78a8")
        .encode(
            x=_layer_axis("predicted MoE layer ℓ+1"),
            y=alt.Y("recall:Q", title="recall |pred ∩ actual| ÷ k", scale=alt.Scale(domain=[0, 1])),
            tooltip=[
                alt.Tooltip("layer:O", title="predicted layer"),
                alt.Tooltip("from_layer:O", title="from layer"),
                alt.Tooltip("recall:Q", format=".1%"),
                alt.Tooltip("tokens:Q"),
            ],
        )
        .properties(title=title, height=200, autosize=FIT_WIDTH)
    )


def capacity_drop_chart(
    layers: pd.DataFrame, *, title: str = "Dropped fraction vs capacity factor"
) -> alt.Chart:
    """Dropped fraction of the (token, expert) assignments against the capacity factor, one line per layer.

    Input: `CapacityResult.layers_frame()` (columns layer, cf, policy, capacity, dropped_fraction, …).
    """
    data = layers[["layer", "cf", "policy", "capacity", "dropped_fraction"]].copy()
    data["dropped_fraction"] = data["dropped_fraction"].astype(np.float64)
    if data["layer"].nunique() <= MAX_CATEGORICAL:
        colour = alt.Color("layer:N", title="MoE layer", legend=alt.Legend(orient="bottom"))
    else:  # 58 layers (DeepSeek-V3): a gradient over the layers, not a legend of 58 entries cut at the edge
        colour = alt.Color(
            "layer:Q",
            title="MoE layer",
            scale=alt.Scale(scheme="viridis"),
            legend=alt.Legend(orient="bottom", format="d"),
        )
    return (
        alt.Chart(data)
        .mark_line(point=True)
        .encode(
            x=alt.X(
                "cf:Q",
                title="capacity factor CF",
                scale=alt.Scale(zero=False),
                axis=alt.Axis(labelOverlap=True),
            ),
            y=alt.Y("dropped_fraction:Q", title="dropped fraction", axis=alt.Axis(format="%")),
            color=colour,
            detail="layer:N",
            tooltip=[
                alt.Tooltip("layer:O"),
                alt.Tooltip("cf:Q", title="CF"),
                alt.Tooltip("capacity:Q", title="capacity C"),
                alt.Tooltip("dropped_fraction:Q", format=".2%", title="dropped"),
            ],
        )
        .properties(title=title, height=220, autosize=FIT_WIDTH)
    )


def position_drop_chart(position: pd.DataFrame, *, title: str = "Drop rate by position") -> alt.Chart:
    """Drop rate per position bucket of the dispatch group (the "drops towards the end" curve), one line per
    capacity factor.

    Input: `CapacityResult.position_frame()` (columns cf, bucket, bucket_start, bucket_end — fractions of the
    sequence — and drop_rate).
    """
    data = position[["cf", "bucket", "bucket_start", "bucket_end", "drop_rate"]].copy()
    data["drop_rate"] = data["drop_rate"].astype(np.float64)
    data["cf_label"] = [f"CF {cf:g}" for cf in data["cf"]]
    order = [f"CF {cf:g}" for cf in sorted(set(data["cf"]))]
    return (
        alt.Chart(data)
        .mark_line(point=True)
        .encode(
            x=alt.X(
                "bucket:O", title="position bucket (start of the group → end)", axis=alt.Axis(labelAngle=0)
            ),
            y=alt.Y("drop_rate:Q", title="drop rate", axis=alt.Axis(format="%")),
            color=alt.Color(
                "cf_label:N", title="capacity factor", sort=order, legend=alt.Legend(orient="bottom")
            ),
            tooltip=[
                alt.Tooltip("cf:Q", title="CF"),
                alt.Tooltip("bucket:O"),
                alt.Tooltip("bucket_start:Q", format=".0%", title="from (share of the sequence)"),
                alt.Tooltip("bucket_end:Q", format=".0%", title="to"),
                alt.Tooltip("drop_rate:Q", format=".2%", title="drop rate"),
            ],
        )
        .properties(title=title, height=220, autosize=FIT_WIDTH)
    )


def overflow_heatmap(
    experts: pd.DataFrame, cf: float, *, title: str | None = None
) -> alt.Chart | alt.VConcatChart | alt.LayerChart:
    """Layer × expert heatmap of the share of each expert's assignments dropped at one capacity factor
    (0 = fits, white; darker = overflows more).

    Input: `CapacityResult.experts_frame()` (columns layer, cf, expert, assigned, dropped, dropped_fraction).
    Over MAX_CATEGORICAL experts (256 on DeepSeek-V3 shapes: a label per expert cannot fit), the pages'
    layer × expert heatmap at scale: an overview of every expert with a brush, the brushed range in detail.
    """
    data = experts[np.isclose(experts["cf"].astype(np.float64), cf)][
        ["layer", "cf", "expert", "assigned", "dropped", "dropped_fraction"]
    ].copy()
    data["dropped_fraction"] = data["dropped_fraction"].astype(np.float64)
    scale = alt.Scale(
        range=["#ffffff", "#a63603"],
        interpolate="rgb",
        domain=[0, max(float(data["dropped_fraction"].max()) if len(data) else 0.0, 1e-9)],
    )
    heading = title or f"Overflowing experts at CF {cf:g}"
    if data["expert"].nunique() > MAX_CATEGORICAL:
        return layer_expert_heatmap(
            data.assign(count=data["assigned"]),
            "dropped_fraction",
            title=heading,
            colour_scale=scale,
            legend_title="dropped",
        )
    layers = int(data["layer"].nunique()) if len(data) else 1
    return (
        alt.Chart(data)
        .mark_rect(stroke=PAPER, strokeWidth=0.5)
        .encode(
            x=alt.X("expert:O", axis=alt.Axis(labelAngle=0)),
            y=alt.Y("layer:O", title="MoE layer"),
            color=alt.Color(
                "dropped_fraction:Q", title="dropped", scale=scale, legend=alt.Legend(format="%")
            ),
            tooltip=[
                alt.Tooltip("layer:O"),
                alt.Tooltip("expert:O"),
                alt.Tooltip("assigned:Q"),
                alt.Tooltip("dropped:Q"),
                alt.Tooltip("dropped_fraction:Q", format=".1%", title="dropped share"),
            ],
        )
        .properties(
            title=alt.Title(heading, subtitle="share of assignments dropped"),
            height=min(max(26 * layers, 100), 700),
            autosize=FIT_WIDTH,
        )
    )


def flip_rate_chart(layers: pd.DataFrame, *, title: str = "Expert-set flip rate per layer") -> alt.Chart:
    """Bars of the flip rate 1 − |S ∩ S′| / k per layer, grouped by format (and target) when several
    `QuantResult.layers_frame()` are stacked.

    Input: `QuantResult.layers_frame()` (columns layer, dtype, target, flip_rate, top1_agreement, tokens).
    """
    data = layers[["layer", "dtype", "target", "flip_rate", "top1_agreement", "tokens"]].copy()
    data["flip_rate"] = data["flip_rate"].astype(np.float64)
    data["format"] = [f"{d} ({t})" for d, t in zip(data["dtype"], data["target"], strict=True)]
    top = _rate_scale(data["flip_rate"])
    formats = list(dict.fromkeys(data["format"]))
    return (
        alt.Chart(data)
        .mark_bar()
        .encode(
            x=_layer_axis(),
            xOffset=alt.XOffset("format:N", scale=alt.Scale(domain=formats)),
            y=alt.Y("flip_rate:Q", title="flip rate 1 − |S∩S′|/k", axis=alt.Axis(format="%"), scale=top),
            color=alt.Color(
                "format:N",
                title="format (target)",
                scale=alt.Scale(domain=formats),
                legend=alt.Legend(orient="bottom"),
            ),
            tooltip=[
                alt.Tooltip("layer:O"),
                alt.Tooltip("format:N", title="format (target)"),
                alt.Tooltip("flip_rate:Q", format=".2%", title="flip rate"),
                alt.Tooltip("top1_agreement:Q", format=".2%", title="top-1 agreement"),
                alt.Tooltip("tokens:Q"),
            ],
        )
        .properties(title=title, height=220, autosize=FIT_WIDTH)
    )


def margin_flips_chart(margins: pd.DataFrame, *, title: str = "Flips by router margin quartile") -> alt.Chart:
    """Bars of the flip rate per router-margin quartile (1 = the lowest margins), one group per layer: flips
    should concentrate where the router hesitated.

    Input: `QuantResult.margin_frame()` (columns layer, quartile, margin_low, margin_high, flip_rate, tokens).
    """
    data = margins[["layer", "quartile", "margin_low", "margin_high", "flip_rate", "tokens"]].copy()
    data["flip_rate"] = data["flip_rate"].astype(np.float64)
    top = _rate_scale(data["flip_rate"])
    return (
        alt.Chart(data)
        .mark_bar()
        .encode(
            x=alt.X("quartile:O", title="router margin quartile (1 = lowest)", axis=alt.Axis(labelAngle=0)),
            xOffset=alt.XOffset("layer:N"),
            y=alt.Y("flip_rate:Q", title="flip rate", axis=alt.Axis(format="%"), scale=top),
            color=alt.Color("layer:N", title="MoE layer", legend=alt.Legend(orient="bottom")),
            tooltip=[
                alt.Tooltip("layer:O"),
                alt.Tooltip("quartile:O"),
                alt.Tooltip("margin_low:Q", format=".4f", title="margin from"),
                alt.Tooltip("margin_high:Q", format=".4f", title="margin to"),
                alt.Tooltip("flip_rate:Q", format=".2%", title="flip rate"),
                alt.Tooltip("tokens:Q"),
            ],
        )
        .properties(title=title, height=220, autosize=FIT_WIDTH)
    )


def params_chart(
    sizes: pd.DataFrame, *, title: str = "Parameters: total vs active per token"
) -> alt.LayerChart:
    """One row per model: a dot at its total parameters and one at those active for one token, joined by a
    line (log scale: the models span orders of magnitude).

    Input: a frame with columns name, total_params, active_params (one row per `ModelSize`).
    """
    data = sizes[["name", "total_params", "active_params"]].melt(
        id_vars=["name"], value_vars=["total_params", "active_params"], var_name="kind", value_name="params"
    )
    data["kind"] = data["kind"].map({"total_params": "total", "active_params": "active per token"})
    data["params"] = data["params"].astype(np.float64)
    kinds = ["total", "active per token"]
    names = list(dict.fromkeys(sizes["name"]))
    x = alt.X(
        "params:Q",
        title="parameters (log scale)",
        scale=alt.Scale(type="log"),
        axis=alt.Axis(format="~s", labelOverlap=True),
    )
    y = alt.Y("name:N", title=None, sort=names, axis=alt.Axis(labelLimit=260))
    line = alt.Chart().mark_line(color="#bbbbbb", strokeWidth=2).encode(x=x, y=y, detail="name:N")
    dots = (
        alt.Chart()
        .mark_point(filled=True, size=110, opacity=1)
        .encode(
            x=x,
            y=y,
            color=alt.Color(
                "kind:N",
                scale=alt.Scale(domain=kinds, range=["#4c78a8", "#f58518"]),
                legend=alt.Legend(orient="bottom", title=None),
            ),
            tooltip=[
                alt.Tooltip("name:N", title="model"),
                alt.Tooltip("kind:N"),
                alt.Tooltip("params:Q", format=",.0f", title="parameters"),
            ],
        )
    )
    return layered_chart(
        line, dots, data=data, title=title, height=min(max(30 * len(names), 120), 700), autosize=FIT_WIDTH
    )
