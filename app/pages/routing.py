"""Routing: which experts each token of a prompt (or of a routing file) was sent to, layer by layer, and one
token in detail."""

import altair as alt
import streamlit as st
from components import caches, expert_axis, exports, page_input, pickers, share, warmup, widgets
from components.routing_frames import ChartMemo, band_text, layer_line
from components.scale import at_scale, trace_at_scale

from moeviz import snippets
from moeviz.analysis import (
    coactivation_pair_counts,
    expert_scores_frame,
    token_confidence_frame,
    token_scores_frame,
)
from moeviz.charts import (
    attention_row_chart,
    attention_row_frame,
    bin_size,
    binned_dispatch_heatmap,
    expert_timeline_chart,
    layer_expert_heatmap,
    router_score_heatmap,
    token_layer_scores_chart,
    token_margin_chart,
    token_options,
    token_path_chart,
    token_rank_path_chart,
    token_strip_chart,
    token_window,
)
from moeviz.charts.scale import order_in_data

MAX_TOKENS = 200  # tokens per heatmap window
MAX_KEYS = 200  # keys shown of a token's attention row
SCALE_TOKENS = 64  # tokens per heatmap window over 20 experts (× the top-N experts: the browser draws each)
SCALE_BINS = 50  # bins of the whole-input overview over 20 experts
CONFIDENCE_TABLE = "Its margins and confidence per layer, as a table"
WAITING_FOR_TORCH = "Loading torch and transformers to recompute this token's attention (once per server)…"

st.title("Routing")
source = pickers.model_picker()
chosen = page_input.page_input(source)
trace = page_input.trace_or_stop(chosen, "which experts each token chose (per-token routing)")
# Over 20 experts (DeepSeek-V3, Kimi-K2: 256–384) the views at scale, from per-layer frames; up to 20 the
# 8-expert views, from frames of every layer built once (`routing_frames.frames_for` picks).
SCALE = trace_at_scale(trace)
frames = page_input.routing_frames(chosen)
# An engine's routing may lack router scores (every score-based view then says so, once, below) and rank
# its slots by expert id (no top-1)
SCORES, RANKED = page_input.has_scores(trace), page_input.is_ranked(trace)
st.caption(
    f"{trace.model.architecture} · {len(trace.tokens)} tokens · {len(trace.layer_keys)} MoE layers"
    + (f" · {chosen.label}" if chosen.from_file else "")
)
page_input.not_shown(
    trace,
    scores="the router-score colours of the heatmap and of the expert timeline, the token's scores, margins "
    "and confidence",
    top1="the token strip (top-1 expert) and the top-1 line of the token's path",
)
num_tokens = max(trace.layer(layer, site).logits.shape[0] for site, layer in trace.layer_keys)  # per layer
# The per-layer charts at scale already built in this session, by their inputs (`ChartMemo`): a sort
# leaves the strip and the load curve alone, a sort back or a layer seen again finds its heatmaps built.
MEMO = st.session_state.setdefault("routing_chart_memo", ChartMemo())


def memo(name: str, axis: expert_axis.ExpertAxis, key: tuple, build):
    """`build()`, or at scale the chart of (`name`, this input, `key`) already built (`ChartMemo`)."""
    if not axis.at_scale:  # up to 20 experts every layer's frames are at hand and the charts small
        return build()
    return MEMO.get((name, chosen.key, num_tokens, WINDOW, lo, SCORES, RANKED, *key), build)


# Each interaction reruns only the fragment that shows it: a layer switch redraws the layer's views, a
# clicked cell redraws the heatmap and its token, an expert choice redraws the timeline. Widgets that
# change everything (model, prompt, window) stay outside.
# At scale the detail window is narrower (each token is a column of N experts) and the overview coarser.
WINDOW, BINS = (SCALE_TOKENS, SCALE_BINS) if SCALE else (MAX_TOKENS, 100)
start = 0
if num_tokens > WINDOW:
    st.info(f"{num_tokens} tokens: the overview below is binned; the detailed views show a window.")
    if "routing_start" in st.session_state:  # a link to one token (Engines page) sets it: clamp to this input
        kept_start = int(st.session_state["routing_start"])
        st.session_state["routing_start"] = min(max(kept_start, 0), num_tokens - WINDOW)
    start = st.slider(
        "First token shown", 0, num_tokens - WINDOW, step=max(WINDOW // 4, 1), key="routing_start"
    )
lo, _ = token_window(num_tokens, max_tokens=WINDOW, start=start)


@st.fragment
def layer_views() -> None:
    """The chosen MoE layer: the expert axis (over 20 experts: searchable picker, then sort and top-N),
    binned overview, token strip (at scale by expert group or id, the chosen expert outlined, below the
    heatmap), the score heatmap of the shown experts with its drill-down, expert load."""
    site, layer = pickers.pick_layer(trace)
    st.caption(layer_line(layer, frames.layer_balance(site, layer)))
    load = frames.layer_load(site, layer)
    # the layer's busiest expert, unless one was chosen by hand on this model (a kept id may be dead here)
    pickers.default_expert(pickers.input_model(chosen), pickers.busiest_expert(load))
    if not at_scale(trace.layer(layer, site).num_experts):
        axis = ordered_views(site, layer, load, None)
    else:
        # At scale the picker sits outside the views a sort changes (`ordered_views`, a fragment of its own:
        # a sort or a new top-N reruns the two heatmaps alone); the chosen expert is shown by every view
        # (a row of the heatmaps, the strip's outline, the curve's mark), so a pick reruns them all.
        picker, _ = st.columns([3, 3])
        with picker:
            expert = expert_axis.pick_expert(load)
        axis = ordered_fragment(site, layer, load, expert)
        if RANKED:  # below the heatmap: the same window of tokens
            token_strip(site, layer, axis)
    load_view(site, layer, axis)
    if not axis.at_scale:
        reproduce(site, layer, axis)


def ordered_views(site: str, layer: int, load, expert: int | None) -> expert_axis.ExpertAxis:
    """The views that list the experts in the axis's order (binned overview, score heatmap with its
    drill-down) and the axis itself: at scale (`expert` chosen) its sort and top-N; up to 20 experts every
    expert by id, and the token strip between them. → the axis."""
    if expert is None:
        axis = expert_axis.expert_axis(load)
    else:
        axis = expert_axis.ordered_axis(load, expert, lambda: coactivation_pair_counts(trace, layer, site))
    scores = frames.layer_scores(site, layer, axis.shown)
    # Overview (and up to 20 experts the strip) sit above the heatmap but are drawn after it: the heatmap,
    # what a layer switch is for, reaches the browser first. Both heatmaps take the expert order from their
    # data (`order_in_data`): a sort or a picked expert changes their data alone, which the browser patches
    # into the drawn charts.
    # At scale the charts' specs do not change with the layer or the chosen expert (titles name no layer —
    # the slider and the line above do —, sizes and subtitles depend on the top-N alone, the chosen expert
    # is a column of the data): the browser then swaps the data into the charts it has drawn instead of
    # building new ones, most of what a layer switch cost there.
    above = st.container()
    heatmap_and_token(site, layer, axis, scores)
    with above:
        if num_tokens > WINDOW:
            top_n = int(st.session_state.get("expert_top_n", len(axis.shown)))
            exports.show_chart(
                memo(
                    "binned",
                    axis,
                    (site, layer, tuple(axis.shown), top_n),
                    lambda: binned_view(scores, axis),
                ),
                "binned",
                file_title_suffix=layer_in_file(layer),
            )
        if RANKED and not axis.at_scale:  # its colour is each token's top-1 expert (else `not_shown` says)
            token_strip(site, layer, axis)
    if axis.at_scale:  # here, with the experts it names: a new top-N reruns it too
        reproduce(site, layer, axis)
    return axis


def reproduce(site: str, layer: int, axis: expert_axis.ExpertAxis) -> None:
    """The snippet of this layer's views (at scale with the experts they list)."""
    share.reproduce(
        lambda: snippets.routing_view(
            share.snippet_input(source, chosen),
            layer,
            site,
            token=share.kept_token(),
            experts=axis.shown if axis.at_scale else None,
            max_tokens=WINDOW,
            start=lo,
        ),
        "this layer's views",
    )


ordered_fragment = st.fragment(ordered_views)


def binned_view(scores, axis: expert_axis.ExpertAxis) -> alt.TopLevelMixin:
    """The binned overview of the whole input, experts in `axis.shown`'s order."""
    binned = binned_dispatch_heatmap(scores, max_bins=BINS, title="Dispatch over the whole input")
    if axis.at_scale:
        binned = steady_binned(binned, axis)
    return exports.many_marks(order_in_data(binned, axis.shown), BINS * len(axis.shown))


def layer_in_file(layer: int) -> str:
    """What a per-layer chart's saved files add to its title. The chart on the page names no layer (the
    slider and the line above do): its spec then stays the same from layer to layer, and a layer switch
    swaps the data into the drawn chart instead of building a new one (0.50 → 0.32 s on the sample)."""
    return f", layer {layer}"


def steady_binned(chart: alt.Chart, axis: expert_axis.ExpertAxis) -> alt.Chart:
    """The binned overview at scale with a height and subtitle set by the top-N alone: a chosen expert
    outside the top-N (one row more) then changes its data, not its spec."""
    top_n = int(st.session_state.get("expert_top_n", len(axis.shown)))
    size = bin_size(num_tokens, BINS)
    bins = -(-num_tokens // size)
    subtitle = (
        f"{num_tokens:,} tokens in {bins} bins of {size} · the {top_n} busiest experts and the chosen one · "
        "colour = share of a bin's tokens sent to the expert"
    )
    return chart.properties(
        title=alt.Title(chart.title.text, subtitle=subtitle), height=min(max(18 * (top_n + 1), 120), 640)
    )


def token_strip(site: str, layer: int, axis: expert_axis.ExpertAxis) -> None:
    """The window's tokens coloured by their top-1 expert at the layer (at scale by group or expert id)."""
    routing = trace.layer(layer, site)
    strip = memo(
        "strip",
        axis,
        (site, layer, axis.expert),
        lambda: exports.many_marks(
            token_strip_chart(
                frames.layer_routing(site, layer),
                num_experts=routing.num_experts,
                max_tokens=WINDOW,
                start=lo,
                title="Tokens by top-1 expert",
                n_group=routing.n_group,
                highlight=axis.expert,
            ),
            2 * min(num_tokens, WINDOW),
        ),
    )
    exports.show_chart(strip, "strip", file_title_suffix=layer_in_file(layer))
    colour = (
        "Each token is coloured by the expert with the largest combination weight at this layer"
        if routing.has_weights
        else "Each token is coloured by its first-ranked expert at this layer (the engine's order; the file "
        "has no combination weights)"
    )
    if not axis.at_scale:
        st.caption(f"{colour}; hover for it.")
    else:
        grouped = routing.n_group and routing.n_group > 1
        st.caption(
            f"{colour}: "
            + (
                f"by its group ({routing.n_group} groups of {routing.num_experts // routing.n_group} experts)"
                if grouped
                else "on a continuous scale of expert ids"
            )
            + f"; outlined: tokens whose top-1 is expert {axis.expert}. Hover for the expert."
        )


@st.fragment
def heatmap_and_token(site: str, layer: int, axis: expert_axis.ExpertAxis, scores) -> None:
    """The layer's score heatmap of the shown experts and the token clicked in it (a click reruns only
    this): up to 20 experts its drill-down below; at scale the click asks for the drill-down, a fragment
    of its own (a full rerun)."""
    routing = trace.layer(layer, site)
    heading = "Router scores" if SCORES else "Dispatch"  # no scores: the chart draws the dispatch alone

    def build() -> alt.TopLevelMixin:
        heatmap = router_score_heatmap(scores, max_tokens=WINDOW, start=lo, title=heading, experts=axis.shown)
        marks = min(num_tokens, WINDOW) * len(axis.shown)
        return exports.many_marks(order_in_data(heatmap, axis.shown), marks)

    heatmap = memo("heatmap", axis, (site, layer, tuple(axis.shown)), build)
    event = exports.show_chart(heatmap, "heatmap", select=True, file_title_suffix=layer_in_file(layer))
    colour = (
        f"Colour = router score = {routing.score_fn}(router logits), before top-k. ● = expert the token was "
        "dispatched to; hover a cell for its logit and the combination weight the model used (0 where not "
        "dispatched)."
        if SCORES
        else "Filled with ● = expert the token was dispatched to (no router scores to colour by)."
    )
    st.caption(
        f"{axis.shown_sentence(' at this layer')}{colour} Click a cell to open its token below. Where the "
        "token labels would overlap (long windows, narrow pages) only every n-th is printed; every cell's "
        "tooltip names its token."
    )
    pickers.remember_cell(event)  # the clicked cell's expert, for the Why page
    clicked = pickers.clicked_token(event)
    if not axis.at_scale:
        token_detail(site, layer, clicked)
    elif widgets.new_click(clicked, "scale_cell_clicked"):
        st.session_state["scale_token_click"] = clicked
        st.session_state["scale_token_detail"] = True  # a click asks for its token's drill-down
        st.rerun()  # the whole page: the drill-down is a fragment of its own


def token_detail(site: str, layer: int, clicked: tuple[int, int] | None) -> None:
    st.subheader("One token in detail", anchor="token")
    # The tokens of the window on show (a long input's picker would ship every token to the browser).
    seq, pos = pickers.pick_token(token_options(trace.tokens.iloc[lo : lo + MAX_TOKENS]), clicked)
    label = st.session_state["token"]
    path = frames.routing[(frames.routing["seq"] == seq) & (frames.routing["pos"] == pos)]
    path_chart = token_path_chart(path, title=f"Experts of {label!r}" if not SCORES else None, ranked=RANKED)
    if not chosen.from_file:  # the Why page explains the prompt, run through the model
        pickers.link_to_why(seq, pos)
    with st.container(key="drilldown"):
        if not SCORES:  # its experts alone (`not_shown` named the scores, margins and confidence above)
            exports.show_chart(path_chart, "token_path")
            st.caption(path_caption())
            shown = path[["layer", "rank", "expert"]] if RANKED else path[["layer", "expert"]]
            token_table(shown, path, "token_routing", "Its experts per layer, as a table")
            attention_row(layer, seq, pos)
            return
        mine_conf, scores_chart, margin_chart = token_charts(seq, pos, label)
        # the scores full width, path and margin side by side: readable from 900 px (three columns were not)
        exports.show_chart(scores_chart, "token_scores")
        st.caption("Router scores of this token at every MoE layer; ● = dispatched.")
        c2, c3 = st.columns(2)
        with c2:
            exports.show_chart(path_chart, "token_path")
            st.caption(path_caption())
        with c3:
            exports.show_chart(margin_chart, "token_margin")
            st.caption(expert_axis.margin_caption(trace.layer(layer, site)))
        token_table(mine_conf, mine_conf, "token_confidence", CONFIDENCE_TABLE)
        attention_row(layer, seq, pos)


def token_table(shown, downloaded, name: str, label: str) -> None:
    """The token's rows `shown` as a table, with `downloaded` as CSV and Parquet files, in an expander built
    only while open (the table's grid cost the first page's browser ~0.2 s and 1.2 MB of scripts)."""
    with st.expander(label, icon=":material/table:", key=f"{name}_table", on_change="rerun") as box:
        if box.open:
            st.dataframe(shown, hide_index=True)
            exports.table_downloads(downloaded, name)


def path_caption() -> str:
    """What the token's path shows: dot size only with combination weights, the top-1 line only with ranked
    slots."""
    parts = ["Its experts layer by layer"]
    if any(r.has_weights for r in trace.layers):
        parts.append("dot size = combination weight")
    if RANKED:
        parts.append("dashed line joins the top-1 experts")
    return "; ".join(parts) + "."


def token_charts(seq: int, pos: int, label: str):
    """The token's confidence rows and its two score charts (scores, margin)."""
    mine = frames.scores[(frames.scores["seq"] == seq) & (frames.scores["pos"] == pos)]
    mine_conf = frames.confidence[(frames.confidence["seq"] == seq) & (frames.confidence["pos"] == pos)]
    return (
        mine_conf,
        token_layer_scores_chart(mine, title=f"Scores of {label!r}"),
        token_margin_chart(mine_conf),
    )


# In parallel with the rest of the page: on a new server's first page, drawn before torch is imported, the
# row waits for the import (it recomputes attention from the model's forward), which starts once the main
# script's run is done (app/streamlit_app.py), while the views below the row are drawn.
@st.fragment(parallel=True)
def attention_row(layer: int, seq: int, pos: int) -> None:
    if chosen.from_file:  # attention is captured from the model's forward, which a routing file has not
        return
    st.markdown("**Its attention row**")
    if not warmup.done():
        with st.spinner(WAITING_FOR_TORCH):
            warmup.wait(start_now=False)  # started once the page's other views are drawn
    att = caches.get_attention(*chosen.key)
    if att is None or not att.map_layers:
        st.info("This model has no softmax attention map for this token.", icon=":material/info:")
        return
    layers = att.map_layers
    if layer in layers and "attention_layer" not in st.session_state:
        st.session_state["attention_layer"] = layer  # start at the MoE layer on show
    att_layer, head = pickers.pick_head(layers, att.layers[layers[0]].num_heads, None)
    seq_tokens = trace.tokens[trace.tokens["seq"] == seq]
    row = attention_row_frame(att.row(att_layer, head, seq, pos), seq_tokens, pos=pos, max_keys=MAX_KEYS)
    exports.show_chart(
        attention_row_chart(
            row, title=f"Attention of {st.session_state['token']!r}, layer {att_layer}, head {head}"
        ),
        "token_attention",
    )
    st.caption(
        "p_j = softmax_j(scaling · q · k_j + mask): the share of this token's attention on each "
        f"earlier key (the last {MAX_KEYS} shown; exact, recomputed from the captured queries and keys). "
        "The Attention page shows every head."
    )
    exports.table_downloads(row, "token_attention")


def load_view(site: str, layer: int, axis: expert_axis.ExpertAxis) -> None:
    summary = frames.layer_balance(site, layer)
    load = frames.layer_load(site, layer)
    num_experts = trace.layer(layer, site).num_experts
    dropped = int(summary["dropped"])
    # bootstrap bands (tokens resampled), cached per layer; at scale 400 draws (~0.06 s at 1000 tokens × 256
    # experts, against ~0.5 s for 2000) keep a layer switch quick
    draws = 400 if axis.at_scale else 2000
    bands, spread = caches.layer_load_bands(*chosen.key, site, layer, trace.layer(layer, site), draws)
    # chart full width, then the indicators in one row: readable from 900 px (a side column was not)

    def build() -> alt.TopLevelMixin:
        curve = expert_axis.load_chart(load, axis, title="Expert load", bands=bands)
        if not axis.at_scale:
            return curve
        # its per-layer figures (dead experts, the busiest's load) are in the caption below. A point and a
        # band step per expert, redrawn on every layer switch and pick: on a canvas, without per-mark ARIA
        # text (the caption says what the curve shows). Set in place: a copy deep-copies every layer.
        curve.title = alt.Title("Expert load, sorted", subtitle="dashed = fair share; grey = bootstrap band")
        return exports.many_marks(curve, 2 * num_experts)

    exports.show_chart(
        memo("load", axis, (site, layer, axis.expert, draws), build),
        "load",
        file_title_suffix=layer_in_file(layer),
    )
    # indicators side by side at their own width, wrapping to a second row on a narrow page (never cut)
    metrics = st.container(horizontal=True, gap="large")
    metrics.metric(
        "Load entropy",
        f"{summary['load_entropy']:.2f}",
        help="H(load) / log E; 1 = perfectly even" + band_text(spread, "load_entropy", "{:.2f}"),
        width="content",
    )
    metrics.metric(
        "Max share",
        f"{summary['max_share']:.0%}",
        help=f"The busiest expert's share of all kT slots; the fair share is {1 / num_experts:.1%}"
        + band_text(spread, "max_share", "{:.1%}"),
        width="content",
    )
    metrics.metric(
        "Dead experts", int(summary["dead_experts"]), help="Experts that received no token", width="content"
    )
    if dropped:
        metrics.metric(
            "Dropped",
            f"{summary['dropped_fraction']:.1%}",
            help=f"{dropped:,} of the kT slots dropped by expert capacity (no expert ran them)",
            width="content",
        )
    if axis.at_scale:
        used = load[load["expert"] >= 0]
        fair = used["count"].sum() / max(len(used), 1)
        busiest = used["count"].max() / fair if fair > 0 else 0.0
        st.caption(
            f"Layer {layer}: {len(used)} experts, {int((used['count'] == 0).sum())} dead, the busiest at "
            f"{busiest:.2f}× its fair share. "
            "Curve: each expert's utilisation c_e / (kT/E), busiest first (a token counts once per "
            "expert it uses); dashed line: the fair share kT/E; the chosen expert marked. Dropped slots "
            f"are not drawn (see the Dropped metric). Grey band: 90% bootstrap band ({draws} draws, "
            "tokens resampled; too narrow for one text, whose tokens are not independent)."
        )
    else:
        st.caption(
            "Bars: tokens dispatched to each expert in this layer (a token counts once per expert it "
            "uses). Dashed line: the fair share kT/E, what every expert would get if the load were even; "
            "grey bar: the slots dropped by expert capacity (when any). Whiskers: 90% bootstrap band "
            "(tokens resampled; too narrow for one text, whose tokens are not independent)."
        )
    exports.routing_downloads(trace, frames.routing)


@st.fragment
def expert_timeline() -> None:
    """One expert's score over layers × tokens (an expert choice reruns only this); at scale drawn on
    request (layers × tokens marks for the browser)."""
    st.subheader("One expert across layers")
    if SCALE and not widgets.toggle(
        "Show one expert's score at every layer" if SCORES else "Show one expert's tokens at every layer",
        "scale_timeline",
        help=f"{len(trace.layer_keys)} layers × up to {WINDOW} tokens: drawn only when asked for.",
    ):
        return
    sites = list(dict.fromkeys(site for site, _ in trace.layer_keys))
    site = st.selectbox("Site", sites, key="timeline_site") if len(sites) > 1 else sites[0]
    # its own picker (the expert axis above has one at scale), sharing the kept expert
    expert = expert_axis.pick_expert(frames.load[frames.load["site"] == site], widget_key="timeline_expert")
    exports.show_chart(
        exports.many_marks(
            expert_timeline_chart(
                expert_scores_frame(trace, expert, site), expert, max_tokens=WINDOW, start=lo
            ),
            min(num_tokens, WINDOW) * len(trace.layer_keys),
        ),
        "timeline",
    )
    st.caption(
        "Colour = this expert's router score for each token at each MoE layer; ● = the token was sent to it."
        if SCORES
        else "Filled with ● = the token was sent to this expert at that MoE layer (no router scores)."
    )


# ---- the token's drill-down over 20 experts ----------------------------------------------------------------
# Its own fragment, moved by a heatmap click (a full rerun) and drawn on request: every layer × every expert
# is tens of thousands of marks for the browser.
RANK_BY = {"score": "router score p", "selection_score": "selection score p + b", "load": "layer load"}


@st.fragment
def token_detail_at_scale() -> None:
    """One token at scale: its scores as a layer × expert heatmap (overview + brushed detail, experts in
    the order chosen above, over all layers), its path as layer × rank, its margins; computed for this
    token alone."""
    st.subheader("One token in detail", anchor="token")
    clicked = st.session_state.get("scale_token_click")
    seq, pos = pickers.pick_token(token_options(trace.tokens.iloc[lo : lo + WINDOW]), clicked)
    if not widgets.toggle(
        "Show this token at every layer",
        "scale_token_detail",
        help=f"{len(trace.layer_keys)} layers × {trace.layers[0].num_experts} experts: drawn when asked for "
        "(a click on a heatmap cell asks for its token).",
    ):
        st.caption(
            "Click a cell of the heatmap above, or switch this on, to see the token's "
            + ("scores, path and margins" if SCORES else "experts")
            + " at every layer."
        )
        return
    label = st.session_state["token"]
    by = st.session_state.get("expert_sort", "id")
    order = frames.order(by)
    expert = st.session_state.get("expert")
    mine = token_scores_frame(trace, seq, pos)
    layers = pickers.layer_options(trace.layer_keys)
    site, layer = layers.get(st.session_state.get("layer"), trace.layer_keys[0])  # the layer on show above
    if not SCORES:  # its experts ranked by load alone (`not_shown` named the scores and margins above)
        with st.container(key="drilldown"):
            exports.show_chart(
                token_rank_path_chart(mine, rank_by="load", load=frames.load, title=f"Path of {label!r}"),
                "token_path",
            )
            st.caption(
                "Where its experts stand in each layer's ranking by load (0 = the layer's busiest expert)."
            )
            exports.table_downloads(mine[mine["dispatched"]], "token_routing")
        return
    if not chosen.from_file:  # the Why page explains the prompt, run through the model
        pickers.link_to_why(seq, pos)
    with st.container(key="drilldown"):
        name = expert_axis.ORDER_NAMES.get(by, by)
        exports.show_chart(
            exports.many_marks(
                layer_expert_heatmap(
                    mine,
                    "score",
                    order=order,
                    highlight=expert,
                    order_name=f"{name} (all layers)" if by != "id" else name,
                    title=f"Scores of {label!r}",
                ),
                len(mine),
            ),
            "token_scores",
        )
        st.caption(
            "Router scores of this token at every MoE layer; ● = dispatched"
            + (f", expert {expert} outlined" if expert is not None else "")
            + ". Experts sorted as chosen above, over all layers. Drag over the overview to show a range."
        )
        confidence = token_confidence_frame(trace, seq, pos)  # after the scores: they reach the page first
        # path and margin one under the other, each the page's width: side by side at 900 px, a half
        # column (~210 px) cut the path's slot legend after slot 3 of 8 and crowded 58 layer labels
        rank_by = st.radio(
            "Rank experts by", list(RANK_BY), format_func=RANK_BY.get, horizontal=True, key="path_rank"
        )
        path = token_rank_path_chart(mine, rank_by=rank_by, load=frames.load, title=f"Path of {label!r}")
        # up to layers × experts cells (an image and its hover bins past RASTER_ABOVE): on a canvas, without
        # per-mark ARIA text
        exports.show_chart(exports.many_marks(path, len(mine)), "token_path")
        st.caption(
            "Where its experts stand in each layer's ranking (0 = first); dot size = combination weight, "
            "colour = slot, dashed line joins the top-1 experts. A dispatched expert below rank k was "
            "promoted by the balancing bias or a group limit."
        )
        exports.show_chart(token_margin_chart(confidence), "token_margin")
        st.caption(expert_axis.margin_caption(trace.layer(layer, site)))
        token_table(confidence, confidence, "token_confidence", CONFIDENCE_TABLE)
        attention_row(layer, seq, pos)


layer_views()
if SCALE:
    token_detail_at_scale()
expert_timeline()
