"""Routing: which experts each token of a prompt was sent to, layer by layer, and one token in detail."""

import state
import streamlit as st

from moeviz.charts import (
    attention_row_chart,
    attention_row_frame,
    binned_dispatch_heatmap,
    expert_load_chart,
    expert_timeline_chart,
    router_score_heatmap,
    token_layer_scores_chart,
    token_margin_chart,
    token_options,
    token_path_chart,
    token_strip_chart,
    token_window,
)

MAX_TOKENS = 200  # tokens per heatmap window
MAX_KEYS = 200  # keys shown of a token's attention row

st.title("Routing")
source = state.model_picker()
text = state.prompt_form()
trace = state.load_or_stop(source, text)
frames = state.routing_frames(source, text)
st.caption(f"{trace.model.architecture} · {len(trace.tokens)} tokens · {len(trace.layer_keys)} MoE layers")
num_tokens = max(trace.layer(layer, site).logits.shape[0] for site, layer in trace.layer_keys)  # per layer

# Each interaction reruns only the fragment that shows it: a layer switch redraws the layer's views, a
# clicked cell redraws the heatmap and its token, an expert choice redraws the timeline. Widgets that
# change everything (model, prompt, window) stay outside.
start = 0
if num_tokens > MAX_TOKENS:
    st.info(f"{num_tokens} tokens: the overview below is binned; the detailed views show a window.")
    start = st.slider("First token shown", 0, num_tokens - MAX_TOKENS, 0, step=max(MAX_TOKENS // 4, 1))
lo, _ = token_window(num_tokens, max_tokens=MAX_TOKENS, start=start)


@st.fragment
def layer_views() -> None:
    """The chosen MoE layer: binned overview, token strip, score heatmap with its drill-down, expert load."""
    site, layer = state.pick_layer(trace)
    routing = trace.layer(layer, site)
    scores = frames.layer_scores(site, layer)
    summary = frames.summary.loc[(site, layer)]
    st.caption(f"Layer {layer}: {int(summary['experts'])} experts, top-{int(summary['top_k'])}")
    # Overview and strip sit above the heatmap but are drawn after it: the heatmap, what a layer switch is
    # for, reaches the browser first.
    above = st.container()
    heatmap_and_token(site, layer)
    with above:
        if num_tokens > MAX_TOKENS:
            state.show_chart(
                state.many_marks(
                    binned_dispatch_heatmap(
                        scores, max_bins=100, title=f"Dispatch over the whole input, layer {layer}"
                    ),
                    100 * routing.num_experts,
                ),
                "binned",
            )
        layer_rows = frames.layer_routing(site, layer)
        state.show_chart(
            state.many_marks(
                token_strip_chart(
                    layer_rows,
                    num_experts=routing.num_experts,
                    max_tokens=MAX_TOKENS,
                    start=lo,
                    title=f"Tokens by top-1 expert, layer {layer}",
                ),
                2 * min(num_tokens, MAX_TOKENS),
            ),
            "strip",
        )
        st.caption(
            "Each token is coloured by the expert with the largest combination weight at this layer; "
            "hover for it."
        )
    load_view(site, layer, routing.num_experts)


@st.fragment
def heatmap_and_token(site: str, layer: int) -> None:
    """The layer's score heatmap and the token clicked in it (a click reruns only this)."""
    scores = frames.layer_scores(site, layer)
    event = state.show_chart(
        state.many_marks(
            router_score_heatmap(
                scores, max_tokens=MAX_TOKENS, start=lo, title=f"Router scores, layer {layer}"
            ),
            min(num_tokens, MAX_TOKENS) * trace.layer(layer, site).num_experts,
        ),
        "heatmap",
        select=True,
    )
    st.caption(
        f"Colour = router score = {trace.layer(layer, site).score_fn}(router logits), before top-k. "
        "● = expert the token was dispatched to; hover a cell for its logit and the combination weight the "
        "model used (0 where not dispatched). Click a cell to open its token below."
    )
    token_detail(layer, state.clicked_token(event))


def token_detail(layer: int, clicked: tuple[int, int] | None) -> None:
    st.subheader("One token in detail", anchor="token")
    # The tokens of the window on show (a long input's picker would ship every token to the browser).
    seq, pos = state.pick_token(token_options(trace.tokens.iloc[lo : lo + MAX_TOKENS]), clicked)
    mine_conf, scores_chart, path_chart, margin_chart = token_charts(seq, pos, st.session_state["token"])
    st.page_link("pages/why.py", label="Why this expert? Attribution and what-if for this token", icon="❓")
    with st.container(key="drilldown"):
        c1, c2, c3 = st.columns(3)
        with c1:
            state.show_chart(scores_chart, "token_scores")
            st.caption("Router scores of this token at every MoE layer; ● = dispatched.")
        with c2:
            state.show_chart(path_chart, "token_path")
            st.caption(
                "Its experts layer by layer; dot size = combination weight, dashed line joins the top-1 "
                "experts."
            )
        with c3:
            state.show_chart(margin_chart, "token_margin")
            st.caption(
                "Top-k margin m = (min_{e∈S} p − max_{e∉S} p) / min_{e∈S} p: how far the weakest chosen "
                "expert beat the best rejected one (0 = a tie decided it)."
            )
        st.dataframe(mine_conf, hide_index=True)
        state.table_downloads(mine_conf, "token_confidence")
        attention_row(layer, seq, pos)


def token_charts(seq: int, pos: int, label: str):
    """The token's confidence rows and its three drill-down charts (scores, path, margin)."""
    mine = frames.scores[(frames.scores["seq"] == seq) & (frames.scores["pos"] == pos)]
    mine_conf = frames.confidence[(frames.confidence["seq"] == seq) & (frames.confidence["pos"] == pos)]
    path = frames.routing[(frames.routing["seq"] == seq) & (frames.routing["pos"] == pos)]
    return (
        mine_conf,
        token_layer_scores_chart(mine, title=f"Scores of {label!r}"),
        token_path_chart(path),
        token_margin_chart(mine_conf),
    )


def attention_row(layer: int, seq: int, pos: int) -> None:
    st.markdown("**Its attention row**")
    att = state.get_attention(source, text)
    if att is None or not att.map_layers:
        st.info("This model has no softmax attention map for this token.", icon="ℹ")
        return
    layers = att.map_layers
    if layer in layers and "attention_layer" not in st.session_state:
        st.session_state["attention_layer"] = layer  # start at the MoE layer on show
    att_layer, head = state.pick_head(layers, att.layers[layers[0]].num_heads, None)
    seq_tokens = trace.tokens[trace.tokens["seq"] == seq]
    row = attention_row_frame(att.row(att_layer, head, seq, pos), seq_tokens, pos=pos, max_keys=MAX_KEYS)
    state.show_chart(
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
    state.table_downloads(row, "token_attention")


def load_view(site: str, layer: int, num_experts: int) -> None:
    summary = frames.summary.loc[(site, layer)]
    load = frames.load[(frames.load["layer"] == layer) & (frames.load["site"] == site)]
    left, right = st.columns([3, 2])
    with left:
        state.show_chart(expert_load_chart(load, title=f"Expert load, layer {layer}"), "load")
    with right:
        a, b, c = st.columns(3)
        a.metric("Load entropy", f"{summary['load_entropy']:.2f}", help="H(load) / log E; 1 = perfectly even")
        b.metric("Max share", f"{summary['max_share']:.0%}", help=f"Fair share is {1 / num_experts:.0%}")
        c.metric("Dead experts", int(summary["dead_experts"]), help="Experts that received no token")
        st.caption(
            "Bars: tokens dispatched to each expert in this layer (a token counts once per expert it uses). "
            "Dashed line: the fair share, what every expert would get if the load were even."
        )
        d1, d2 = st.columns(2)
        # Files are built only when clicked; a click does not rerun the page.
        d1.download_button(
            "Routing table (CSV)",
            state.routing_csv(frames.routing),
            "routing.csv",
            "text/csv",
            icon="⬇",
            on_click="ignore",
        )
        d2.download_button(
            "Routing table (Parquet)",
            state.routing_parquet(trace),
            "routing.parquet",
            "application/vnd.apache.parquet",
            icon="⬇",
            on_click="ignore",
        )


@st.fragment
def expert_timeline() -> None:
    """One expert's score over layers × tokens (an expert choice reruns only this)."""
    st.subheader("One expert across layers")
    sites = list(dict.fromkeys(site for site, _ in trace.layer_keys))
    site = st.selectbox("Site", sites, key="timeline_site") if len(sites) > 1 else sites[0]
    layer = next(layer for s, layer in trace.layer_keys if s == site)
    expert = state.pick_expert(trace.layer(layer, site).num_experts)
    state.show_chart(
        expert_timeline_chart(
            frames.scores[frames.scores["site"] == site], expert, max_tokens=MAX_TOKENS, start=lo
        ),
        "timeline",
    )
    st.caption(
        "Colour = this expert's router score for each token at each MoE layer; ● = the token was sent to it."
    )


layer_views()
expert_timeline()
