"""Routing views of one MoE layer: the token × expert router-score heatmap and the per-expert load bars."""

from __future__ import annotations

from collections.abc import Sequence

import altair as alt
import numpy as np
import pandas as pd

from moeviz.charts._common import FIT_WIDTH, INK, layer_band_axis, layered_chart
from moeviz.charts.scale import MAX_CATEGORICAL, add_expert_colour_fields, expert_colour

DOT = "●"
DISPATCH_FILL = "#4c78a8"  # a dispatched cell where there are no router scores to colour by
TOKEN_SELECTION = "token"  # name of the heatmap's click selection
# Fill the width a host gives the chart, but keep the height for the plot (axis labels add to it).
_VISIBLE_WHITESPACE = str.maketrans({" ": "␣", "\n": "↵", "\t": "→", "\r": "␍"})
# Layered charts take their data once, in alt.layer(..., data=...): the same Vega-Lite spec, without altair
# hashing every layer's frame to find out that they share it (a third of a heatmap's build time).


def token_label(pos: int, token: str, seq: int | None = None) -> str:
    """Axis label of one token: "pos:token" (or "seq/pos:token"), whitespace made visible (␣ ↵ →), so that
    repeated tokens stay distinct and a leading space can be seen."""
    text = f"{pos}:{str(token).translate(_VISIBLE_WHITESPACE)}"
    return text if seq is None else f"{seq}/{text}"


def token_window(num_tokens: int, *, max_tokens: int = 400, start: int = 0) -> tuple[int, int]:
    """The [start, stop) token rows a windowed view shows: at most `max_tokens`, clamped to the input."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    start = min(max(int(start), 0), max(num_tokens - max_tokens, 0))
    return start, min(start + max_tokens, num_tokens)


def _window_subtitle(lo: int, hi: int, num_tokens: int) -> str:
    """Which token rows a windowed view shows: "tokens lo–(hi−1) of N", or "N tokens" when all of them."""
    return f"tokens {lo}–{hi - 1} of {num_tokens}" if (lo, hi) != (0, num_tokens) else f"{num_tokens} tokens"


def _labelled(frame: pd.DataFrame) -> list[str]:
    """`token_label` of each row of a frame with columns seq, pos, token (seq shown only when several)."""
    multi_seq = frame["seq"].nunique() > 1
    return [
        token_label(p, t, s if multi_seq else None)
        for s, p, t in zip(frame["seq"], frame["pos"], frame["token"], strict=True)
    ]


def has_values(values) -> bool:
    """Whether a column holds any finite value (router scores and weights are all NaN in routing imported
    from an engine that records only the chosen experts)."""
    return bool(np.isfinite(np.asarray(values, dtype=np.float64)).any())


def _dispatch_dots(base: alt.Chart, size: int) -> alt.Chart:
    """A ● on each cell of `base` whose `dispatched` field is true."""
    return base.transform_filter("datum.dispatched").mark_text(text=DOT, color="#e4572e", fontSize=size)


def router_score_heatmap(
    scores_frame: pd.DataFrame,
    *,
    max_tokens: int = 400,
    start: int = 0,
    title: str | None = None,
    selectable: bool = True,
    experts: Sequence[int] | None = None,
) -> alt.LayerChart:
    """Token × expert heatmap of router scores of one layer, dispatched experts marked with a dot.

    Input: `Trace.scores_frame(layer, site)`, one row per (token, expert), columns row (token index within
    the layer), expert, score, logit, weight (0 where not dispatched), dispatched (bool), seq, pos, token.

    Tokens run along x in input order, labelled by `token_label` ("pos:token"); experts along y. Colour is
    the router score, a ● marks each expert the token was dispatched to; the tooltip gives token, pos,
    expert, score, logit, weight and dispatched. Routing without router scores (all NaN: an engine import
    records only the chosen experts) draws the dispatch alone: dispatched cells filled, the rest faint, no
    score legend; values that are all NaN leave the tooltip.

    Long inputs are windowed, never sent whole: only token rows [start, start + max_tokens) are kept (see
    `token_window`; `start` is clamped so a full window is shown), so a chart carries at most
    max_tokens × experts cells. The subtitle says which window is shown.

    With `selectable`, clicking a cell selects its token: a point selection named `token` over the
    fields seq, pos and expert (`TOKEN_SELECTION`), for hosts that react to selections.

    `experts`: draw only these experts, in this order along y (for hundreds of experts: e.g. the top-N by
    load from `moeviz.analysis.expert_order`, plus the chosen one); all experts by id when None.
    """
    rows = scores_frame["row"].to_numpy()
    num_tokens = int(rows.max()) + 1 if len(rows) else 0
    lo, hi = token_window(num_tokens, max_tokens=max_tokens, start=start)
    cells = scores_frame[(rows >= lo) & (rows < hi)]
    if experts is not None:  # a subset of experts, in this order along y (e.g. top-N by load + the chosen)
        cells = cells[cells["expert"].isin(experts)]
    data = pd.DataFrame(
        {
            "row": cells["row"].to_numpy(),
            "label": _labelled(cells),
            "token": cells["token"].astype(str).to_numpy(),
            "seq": cells["seq"].to_numpy(),
            "pos": cells["pos"].to_numpy(),
            "expert": cells["expert"].to_numpy(),
            "score": cells["score"].to_numpy(dtype=np.float64),
            "logit": cells["logit"].to_numpy(dtype=np.float64),
            "weight": cells["weight"].to_numpy(dtype=np.float64),
            "dispatched": cells["dispatched"].to_numpy(dtype=bool),
        }
    )
    num_experts = int(data["expert"].nunique()) if len(data) else 0
    scored = has_values(data["score"])
    tooltip = [
        alt.Tooltip("token:N"),
        alt.Tooltip("pos:Q"),
        alt.Tooltip("expert:O"),
        *([alt.Tooltip("score:Q", format=".4f"), alt.Tooltip("logit:Q", format=".3f")] if scored else []),
        *([alt.Tooltip("weight:Q", format=".4f")] if has_values(data["weight"][data["dispatched"]]) else []),
        alt.Tooltip("dispatched:N"),
    ]
    base = alt.Chart().encode(
        x=alt.X(
            "label:N",
            sort=alt.EncodingSortField(field="row", op="min"),
            axis=alt.Axis(title="token (pos:token)", labelAngle=-90, labelLimit=90, labelOverlap=True),
        ),
        y=alt.Y(
            "expert:O",
            axis=alt.Axis(title="expert"),
            sort=alt.Undefined if experts is None else [int(e) for e in experts],
        ),
        tooltip=tooltip,
    )
    if scored:
        cells_layer = base.mark_rect().encode(
            color=alt.Color(
                "score:Q", scale=alt.Scale(scheme="blues", zero=True), legend=alt.Legend(title="score")
            ),
        )
    else:  # routing without router scores (an engine import): the dispatch alone, every cell clickable
        cells_layer = base.mark_rect(color=DISPATCH_FILL).encode(
            opacity=alt.condition("datum.dispatched", alt.value(0.9), alt.value(0.12))
        )
    if selectable:
        cells_layer = cells_layer.add_params(
            alt.selection_point(
                name=TOKEN_SELECTION, fields=["seq", "pos", "expert"], on="click", clear="dblclick"
            )
        )
    dot_size = 11 if hi - lo <= 80 else 8 if hi - lo <= 200 else 6  # fewer, wider cells take a bigger dot
    dots = _dispatch_dots(base, dot_size)
    return layered_chart(
        cells_layer,
        dots,
        data=data,
        title=alt.Title(
            title or ("Router scores" if scored else "Dispatch"),
            subtitle=_window_subtitle(lo, hi, num_tokens),
        ),
        height=min(max(22 * num_experts, 120), 640),
        autosize=FIT_WIDTH,
    )


def expert_load_chart(
    load_frame: pd.DataFrame,
    *,
    dropped: int | None = None,
    title: str | None = None,
    bands: pd.DataFrame | None = None,
) -> alt.LayerChart:
    """Bars of tokens dispatched to each expert of one layer, a grey "dropped" bar for the slots capacity
    dropped (when there are any), and a dashed rule at the fair share kT/E.

    Input: the rows of `moeviz.analysis.expert_balance_frame(trace)` for one (layer, site), columns expert,
    count (slots dispatched to it), share (f = count / kT, of all kT slots) and utilisation (count / (kT/E)).
    `dropped`: the layer's dropped slots (`balance_frame`'s `dropped`); by default recovered from the rows
    (kT = count / share). The bars' shares, dropped included, sum to 1; the fair share is kT/E, the count
    every expert would get if balanced and nothing were dropped.

    `bands`: the layer's rows of `moeviz.analysis.null.expert_confidence_frame(trace)` (columns expert,
    share_low, share_high): each bar gets an error bar over its bootstrap band, drawn in tokens
    (share × kT).
    """
    data = load_frame[["expert", "count", "share", "utilisation"]].reset_index(drop=True)
    counts = data["count"].to_numpy(np.float64)
    if dropped is None:
        shares = data["share"].to_numpy(np.float64)
        known = np.nan_to_num(shares) > 0
        slots = float(np.median(counts[known] / shares[known])) if known.any() else counts.sum()
        dropped = max(round(float(slots - counts.sum())), 0)
    slots = counts.sum() + dropped
    data = data.assign(bar=data["expert"].astype(str), kind="expert")
    if dropped:
        extra = {"expert": -1, "count": dropped, "share": dropped / slots, "utilisation": np.nan}
        data = pd.concat([data, pd.DataFrame([{**extra, "bar": "dropped", "kind": "dropped"}])])
        data = data.reset_index(drop=True)
    data["fair"] = slots / len(counts) if len(counts) else 0.0
    order = data["bar"].tolist()
    bars = (
        alt.Chart()
        .mark_bar()
        .encode(
            x=alt.X("bar:N", title="expert", sort=order, axis=alt.Axis(labelAngle=0)),
            y=alt.Y("count:Q", title="tokens dispatched"),
            color=alt.Color(
                "kind:N",
                scale=alt.Scale(domain=["expert", "dropped"], range=["#4c78a8", "#bab0ac"]),
                legend=None,
            ),
            tooltip=[
                alt.Tooltip("bar:N", title="expert"),
                alt.Tooltip("count:Q"),
                alt.Tooltip("share:Q", format=".1%", title="share of all kT slots"),
                alt.Tooltip("utilisation:Q", format=".2f", title="utilisation (1 = fair)"),
            ],
        )
    )
    fair = (
        alt.Chart()
        .mark_rule(color="#e4572e", strokeDash=[6, 4], strokeWidth=2)
        .encode(
            y=alt.Y("max(fair):Q", title="tokens dispatched"),
            tooltip=[alt.Tooltip("max(fair):Q", format=".1f", title="fair share (kT/E)")],
        )
    )
    layers = [bars, fair]
    if bands is not None:
        band = bands.set_index("expert")[["share_low", "share_high"]].astype(np.float64)
        experts = data["expert"].where(data["kind"] == "expert")
        data["count_low"] = experts.map(band["share_low"]) * slots
        data["count_high"] = experts.map(band["share_high"]) * slots
        layers.append(
            alt.Chart()
            .mark_rule(color=INK, strokeWidth=1.5)
            .encode(
                x=alt.X("bar:N", sort=order),
                y=alt.Y("count_low:Q", title="tokens dispatched"),
                y2=alt.Y2("count_high:Q"),
                tooltip=[
                    alt.Tooltip("bar:N", title="expert"),
                    alt.Tooltip("count_low:Q", format=".1f", title="band low (tokens)"),
                    alt.Tooltip("count_high:Q", format=".1f", title="band high (tokens)"),
                ],
            )
        )
    return layered_chart(*layers, data=data, title=title or "Expert load", height=220, autosize=FIT_WIDTH)


# ---- tokens × routing: strip, timeline, drill-down ------------------------------------------------------
STRIP_WIDTH = 16  # tokens per line of the token strip


def token_strip_chart(
    routing_rows: pd.DataFrame,
    *,
    num_experts: int,
    max_tokens: int = 400,
    start: int = 0,
    per_line: int = STRIP_WIDTH,
    title: str | None = None,
    n_group: int | None = None,
    highlight: int | None = None,
) -> alt.LayerChart:
    """The prompt as a strip of tokens, each coloured by its top-1 expert at one layer.

    Input: the rows of `Trace.routing_frame()` for one (layer, site): columns seq, pos, token, rank, expert,
    weight (one row per dispatched slot; rank 0 = the slot with the largest weight, expert -1 = dropped).
    A token whose every slot was dropped is grey. Tokens wrap after `per_line`; at most `max_tokens`
    tokens (window [start, start + max_tokens) in input order) are drawn, two marks per token.

    Colour (`moeviz.charts.scale.expert_colour`): up to 20 experts one categorical colour per expert; above
    that never a categorical legend: by expert group when `n_group` (DeepSeek-style groups, e.g.
    `LayerRouting.n_group`) splits the experts, else a continuous scale by expert id. `highlight`: tokens
    whose top-1 is this expert get a black outline.
    """
    tokens = routing_rows.drop_duplicates(["seq", "pos"]).sort_values(["seq", "pos"])[["seq", "pos", "token"]]
    top1 = routing_rows[routing_rows["rank"] == 0].drop_duplicates(["seq", "pos"])
    weighted = has_values(routing_rows["weight"])  # an engine import may record no weights
    data = tokens.merge(top1[["seq", "pos", "expert", "weight"]], on=["seq", "pos"], how="left")
    data = data.reset_index(drop=True)
    lo, hi = token_window(len(data), max_tokens=max_tokens, start=start)
    data = data.iloc[lo:hi].reset_index(drop=True)
    data["expert"] = data["expert"].fillna(-1).astype(int)
    data["weight"] = data["weight"].fillna(0.0).astype(float)
    data["label"] = _labelled(data)
    data["text"] = data["token"].astype(str).str.translate(_VISIBLE_WHITESPACE).str.slice(0, 10)
    data["slot"] = np.arange(len(data)) % per_line
    data["line"] = np.arange(len(data)) // per_line + lo // per_line
    data["top1"] = np.where(data["expert"] >= 0, data["expert"].astype(str), "dropped")
    if num_experts <= MAX_CATEGORICAL:
        domain = [str(e) for e in range(num_experts)] + ["dropped"]
        colour = alt.Color(
            "top1:N",
            legend=alt.Legend(title="top-1 expert", orient="bottom", direction="horizontal", columns=18),
            scale=alt.Scale(domain=domain, scheme="tableau20" if num_experts > 10 else "tableau10"),
            sort=domain,
        )
    else:  # many experts: group or continuous id colour, dropped tokens grey
        add_expert_colour_fields(data, num_experts, n_group=n_group)
        colour = alt.condition(
            "datum.expert < 0",
            alt.value("#bbbbbb"),
            expert_colour(num_experts, n_group=n_group, title="top-1 expert"),
        )
    base = alt.Chart().encode(
        x=alt.X("slot:O", axis=None),
        y=alt.Y("line:O", axis=None),
        tooltip=[
            alt.Tooltip("label:N", title="token"),
            alt.Tooltip("top1:N", title="top-1 expert"),
            *([alt.Tooltip("weight:Q", format=".3f", title="its weight")] if weighted else []),
        ],
    )
    boxes = base.mark_rect(stroke="white", strokeWidth=2, cornerRadius=3).encode(color=colour)
    # a label never spills into its neighbours on a narrow page: cut to its box, with an ellipsis (hover
    # shows the whole token); `width` is the view's width as laid out in the page
    limit = alt.ExprRef(expr=f"max(width / {per_line} - 6, 8)")
    text = base.mark_text(fontSize=12, color="black", limit=limit).encode(text=alt.Text("text:N"))
    lines = int(data["line"].nunique()) if len(data) else 1
    marks = [boxes, text]
    if highlight is not None:
        # the chosen expert is a column of the data, not a constant of the spec: another choice changes the
        # data alone, which a host that keeps a drawn chart (Streamlit) patches in without a new view
        data["chosen"] = data["expert"] == int(highlight)
        chosen = base.transform_filter("datum.chosen")
        marks.insert(1, chosen.mark_rect(filled=False, stroke=INK, strokeWidth=2.5, cornerRadius=3))
    return layered_chart(
        *marks,
        data=data,
        title=alt.Title(title or "Tokens by top-1 expert", subtitle=_window_subtitle(lo, hi, len(tokens))),
        height=min(28 * lines, 900),
        autosize=FIT_WIDTH,
    )


def expert_timeline_chart(
    all_scores: pd.DataFrame,
    expert: int,
    *,
    max_tokens: int = 400,
    start: int = 0,
    title: str | None = None,
) -> alt.LayerChart:
    """Layer × token heatmap of one expert's router score, dots where the token was dispatched to it.

    Input: `Trace.scores_frame(layer, site)` of every layer stacked with a `layer` column (see
    `moeviz.charts.stack_scores`): columns layer, seq, pos, token, expert, score, dispatched. Only the
    rows of `expert` are drawn, tokens windowed to [start, start + max_tokens) of the input order
    (at most max_tokens × layers cells). Without router scores (all NaN) the dispatch alone is drawn.
    """
    rows = all_scores[all_scores["expert"] == expert]
    order = rows[["seq", "pos"]].drop_duplicates().sort_values(["seq", "pos"]).reset_index(drop=True)
    lo, hi = token_window(len(order), max_tokens=max_tokens, start=start)
    keep = order.iloc[lo:hi].assign(order=np.arange(lo, hi))
    data = rows.merge(keep, on=["seq", "pos"])
    data = pd.DataFrame(
        {
            "order": data["order"].to_numpy(),
            "label": _labelled(data),
            "layer": data["layer"].to_numpy(),
            "score": data["score"].to_numpy(dtype=np.float64),
            "dispatched": data["dispatched"].to_numpy(dtype=bool),
        }
    )
    scored = has_values(data["score"])
    base = alt.Chart().encode(
        x=alt.X(
            "label:N",
            sort=alt.EncodingSortField(field="order", op="min"),
            axis=alt.Axis(title="token (pos:token)", labelAngle=-90, labelLimit=90, labelOverlap=True),
        ),
        y=alt.Y("layer:O", title="MoE layer"),
        tooltip=[
            alt.Tooltip("label:N", title="token"),
            alt.Tooltip("layer:O"),
            *([alt.Tooltip("score:Q", format=".4f")] if scored else []),
            alt.Tooltip("dispatched:N"),
        ],
    )
    if scored:
        cells = base.mark_rect().encode(
            color=alt.Color("score:Q", scale=alt.Scale(scheme="purples", zero=True), title="score")
        )
    else:  # no router scores (an engine import): the dispatch alone
        cells = base.mark_rect(color=DISPATCH_FILL).encode(
            opacity=alt.condition("datum.dispatched", alt.value(0.9), alt.value(0.12))
        )
    dots = _dispatch_dots(base, 9)
    num_layers = int(data["layer"].nunique()) if len(data) else 1
    heading = "router score" if scored else "dispatched"
    return layered_chart(
        cells,
        dots,
        data=data,
        title=alt.Title(title or f"Expert {expert}: {heading} at every layer", subtitle=f"{hi - lo} tokens"),
        height=min(max(24 * num_layers, 80), 600),
        autosize=FIT_WIDTH,
    )


def token_layer_scores_chart(token_scores: pd.DataFrame, *, title: str | None = None) -> alt.LayerChart:
    """One token's router scores at every layer: layer × expert heatmap, dispatched experts dotted.

    Input: the stacked scores frame (see `expert_timeline_chart`) filtered to one token: columns layer,
    expert, score, weight, dispatched.
    """
    data = token_scores[["layer", "expert", "score", "weight", "dispatched"]].reset_index(drop=True)
    data = data.astype({"score": np.float64, "weight": np.float64, "dispatched": bool})
    base = alt.Chart().encode(
        x=alt.X("expert:O", axis=alt.Axis(labelAngle=0)),
        y=alt.Y("layer:O", title="MoE layer"),
        tooltip=[
            alt.Tooltip("layer:O"),
            alt.Tooltip("expert:O"),
            alt.Tooltip("score:Q", format=".4f"),
            alt.Tooltip("weight:Q", format=".4f"),
            alt.Tooltip("dispatched:N"),
        ],
    )
    cells = base.mark_rect().encode(
        color=alt.Color("score:Q", scale=alt.Scale(scheme="blues", zero=True), title="score")
    )
    dots = _dispatch_dots(base, 12)
    layers = int(data["layer"].nunique()) if len(data) else 1
    return layered_chart(
        cells,
        dots,
        data=data,
        title=title or "Scores at every layer",
        height=min(max(26 * layers, 80), 600),
        autosize=FIT_WIDTH,
    )


def token_path_chart(
    token_routing: pd.DataFrame, *, title: str | None = None, ranked: bool = True
) -> alt.LayerChart:
    """One token's experts across layers: a dot per dispatched (layer, expert), sized by weight, the top-1
    experts joined by a line.

    Input: the rows of `Trace.routing_frame()` for one token: columns layer, rank, expert, weight
    (expert -1 = dropped slot, not drawn). Routing without combination weights (all NaN: an engine import)
    draws every dot at one size; `ranked` False (slots in id order, not by weight: Megatron's router trace)
    draws no top-1 line and colours the dots alike.
    """
    data = token_routing[token_routing["expert"] >= 0][["layer", "rank", "expert", "weight"]]
    data = data.reset_index(drop=True).astype({"weight": np.float64})
    weighted = has_values(data["weight"])
    base = alt.Chart().encode(
        x=alt.X("layer:O", title="MoE layer", axis=alt.Axis(labelAngle=0)),
        y=alt.Y("expert:Q", title="expert", axis=alt.Axis(tickMinStep=1)),
    )
    line = base.transform_filter("datum.rank == 0").mark_line(color="#888", strokeDash=[4, 3])
    size = (
        # three legend entries: the legend never grows taller than the chart (it would be cut)
        alt.Size(
            "weight:Q",
            scale=alt.Scale(domain=[0, 1], range=[30, 500]),
            legend=alt.Legend(values=[0.25, 0.5, 1.0]),
            title="weight",
        )
        if weighted
        else alt.value(160)
    )
    colour = (
        alt.Color("rank:O", title="rank", scale=alt.Scale(scheme="viridis"))
        if ranked
        else alt.value(DISPATCH_FILL)
    )
    dots = base.mark_circle(opacity=0.9).encode(
        size=size,
        color=colour,
        tooltip=[
            alt.Tooltip("layer:O"),
            *([alt.Tooltip("rank:O")] if ranked else []),
            alt.Tooltip("expert:Q"),
            *([alt.Tooltip("weight:Q", format=".3f")] if weighted else []),
        ],
    )
    return layered_chart(
        *([line] if ranked else []),
        dots,
        data=data,
        title=title or "Expert path",
        height=220,
        autosize=FIT_WIDTH,
    )


def token_margin_chart(token_confidence: pd.DataFrame, *, title: str | None = None) -> alt.Chart:
    """One token's top-k margin per layer as bars (0 = a near tie decided the set, 1 = clear choice).

    Input: the rows of `moeviz.analysis.confidence_frame(trace)` for one token: columns layer, margin,
    entropy_norm, top1_score, margin_selection optional. For a router with a balancing bias (a non-NaN
    `margin_selection`) the bars are the margin on what the experts were selected on (p + b; over the
    eligible experts of the chosen groups for group-limited routers), with the margin on p on hover;
    otherwise the margin on p. Layer labels turned; where they would touch (58 layers in a half column) on
    every n-th layer, ending on the last (`layer_band_axis`).
    """
    columns = ["layer", "margin", "entropy_norm", "top1_score"]
    biased = "margin_selection" in token_confidence and token_confidence["margin_selection"].notna().any()
    data = token_confidence[columns + (["margin_selection"] if biased else [])].reset_index(drop=True)
    field, axis_title = (
        ("margin_selection", "top-k margin on p + b") if biased else ("margin", "top-k margin")
    )
    # a half column wide on the pages (~380 px at 900 px): labels turned, on every n-th layer when crowded
    axis = layer_band_axis(data["layer"].unique(), min_width=380, angle=-90, labelFontSize=10)
    return (
        alt.Chart(data.astype(np.float64).astype({"layer": int}))
        .mark_bar()
        .encode(
            x=alt.X("layer:O", title="MoE layer", axis=axis),
            y=alt.Y(
                f"{field}:Q",
                scale=alt.Scale(domain=[0, 1]),
                title=axis_title,
                axis=alt.Axis(labelOverlap=False),
            ),
            tooltip=[
                alt.Tooltip("layer:O"),
                *(
                    [alt.Tooltip("margin_selection:Q", format=".3f", title="margin on p + b")]
                    if biased
                    else []
                ),
                alt.Tooltip("margin:Q", format=".3f", title="margin on p"),
                alt.Tooltip("entropy_norm:Q", format=".3f", title="entropy / log E"),
                alt.Tooltip("top1_score:Q", format=".3f", title="top-1 p"),
            ],
        )
        .properties(title=title or "Top-k margin", height=220, autosize=FIT_WIDTH)
    )
