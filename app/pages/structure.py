"""Structure: which experts fire together, how routing flows across layers, and along the text — of the model
on text or of a routing file."""

import streamlit as st
from components import expert_axis, exports, page_input, pickers, share

from moeviz import snippets
from moeviz.analysis import (
    coactivation_frame,
    coactivation_pair_counts,
    expert_balance_frame,
    expert_order,
    filter_experts,
    layer_coactivation_frame,
    layer_trace,
    next_layer_transition_frame,
    path_frame,
    repetition_frame,
    transition_frame,
)
from moeviz.analysis.structure import default_path_length, path_layer_ids, path_window
from moeviz.charts import coactivation_heatmap, path_chart, repetition_chart, transition_heatmaps

st.title("Structure")
source = pickers.model_picker()
chosen = page_input.page_input(source, corpus=True)
trace = page_input.trace_or_stop(chosen, "which experts each token chose, token by token")
if chosen.from_file:
    st.caption(f"{trace.model.architecture} · {len(trace.tokens)} tokens · {chosen.label}")
# Megatron's router trace lists a token's experts by id: top-1 and rank-adjacent views need ranked slots
RANKED = page_input.is_ranked(trace)
page_input.not_shown(
    trace, top1="rank-adjacent co-activation, top-1 transitions, top-1 paths and top-1 repetition"
)
site, layer = pickers.pick_layer(trace)
layer_load = expert_balance_frame(layer_trace(trace, layer, site))
# the layer's busiest expert, unless one was chosen by hand on this model (a kept id may be dead here)
pickers.default_expert(pickers.input_model(chosen), pickers.busiest_expert(layer_load))
# The chosen layer's experts: all of them by id, or over 20 the top-N by load in the order chosen.
axis = expert_axis.expert_axis(layer_load, lambda: coactivation_pair_counts(trace, layer, site))

st.subheader("Co-activation")
adjacent = RANKED and st.toggle(
    "Rank-adjacent pairs only",
    key="coact_adjacent",
    help="Count only experts at consecutive ranks r, r+1 of S_t.",
)
coact_layer = layer_coactivation_frame(trace, layer, site, adjacent_only=adjacent)
shown = filter_experts(coact_layer, axis.shown, "expert", "co_expert")
chart = coactivation_heatmap(shown, title=f"Co-activation, layer {layer}")
exports.show_chart(
    exports.many_marks(expert_axis.sort_axis(chart, axis.shown, "x", "y"), len(shown)), "coactivation"
)
expert_axis.caption_shown(axis, " at this layer", "; the download has all of them")
st.caption(
    "CoAct(i, j) = #{t : i, j ∈ S_t} / #{t : i ∈ S_t}: of the tokens sent to expert i (row), the share also "
    "sent to j. Not symmetric; the diagonal is left out. "
    + (
        "Rank-adjacent variant: only pairs at consecutive ranks count."
        if adjacent
        else "All pairs of S_t count."
    )
)
# the download: every layer while that is small (E² × L rows), this layer at scale
coact = coact_layer if axis.at_scale else coactivation_frame(trace, adjacent_only=adjacent)
exports.table_downloads(coact, "coactivation")

st.subheader("Across layers")
top1 = RANKED and st.toggle(
    "Top-1 only", key="transition_top1", help="Follow only each token's top-1 expert."
)
# every pair of consecutive layers; at scale (E² rows a pair) the chosen layer → the next one
transitions = (
    next_layer_transition_frame(trace, layer, site, top1) if axis.at_scale else transition_frame(trace, top1)
)
if transitions.empty:
    st.info(
        "Transitions need a next MoE layer: pick an earlier layer."
        if axis.at_scale
        else "Transitions need at least two MoE layers."
    )
else:
    shown = filter_experts(transitions[transitions["site"] == site], axis.shown)
    ahead: list[int] = []  # at scale the columns: the next layer's busiest experts, as many as the rows
    if axis.at_scale:
        following = int(transitions["next_layer"].iloc[0])
        busiest = expert_order(expert_balance_frame(layer_trace(trace, following, site)), by="load")
        ahead = busiest[: len(axis.shown)].tolist()
        ahead = sorted(ahead) if axis.by == "id" else ahead
        shown = filter_experts(shown, ahead, "next_expert")
    chart = expert_axis.sort_axis(transition_heatmaps(shown), axis.shown, "y")
    if ahead:
        chart = expert_axis.sort_axis(chart, ahead, "x")
    exports.show_chart(exports.many_marks(chart, len(shown)), "transitions")
    if axis.at_scale:
        st.caption(
            f"Layer {layer} → {following}: rows = the experts shown above, columns = the {len(ahead)} "
            f"busiest experts of layer {following} ({'by id' if axis.by == 'id' else 'busiest first'})."
        )
    st.caption(
        "T(i → j) = P(j ∈ S_t at the next layer | i ∈ S_t at this layer). Rows sum to k (set) or 1 (top-1); "
        "a bright single cell per row = a fixed pathway."
    )
    exports.table_downloads(transitions, "transitions")

if RANKED:  # a path of top-1 experts, over a window of consecutive layers from the chosen one
    chain = path_layer_ids(trace, site)
    hops = default_path_length(len(chain), trace.layer(layer, site).num_experts)
    if len(chain) > 1:  # (a slider needs two values)
        hops = st.slider(
            "Layers in a path",
            1,
            len(chain),
            hops,
            key="path_layers",
            help="Paths over this many consecutive MoE layers, from the layer chosen above: over many layers "
            "and experts nearly every path is unique.",
        )
    window = path_window(chain, layer, hops)
    paths = path_frame(trace, top_n=15, layers=window, site=site)
    span = f"layer {window[0]}" if len(window) == 1 else f"layers {window[0]}–{window[-1]}"
    exports.show_chart(path_chart(paths, title=f"Most frequent expert paths, {span}"), "paths")
    st.caption(
        f"Top-1 expert of each MoE layer in order ({span}), e.g. 3→1→7; share = of tokens routed by all "
        "these layers."
    )
    exports.table_downloads(paths.astype({"path": str, "layers": str}), "paths")

st.subheader("Along the text")
repetition = repetition_frame(trace)
kind = st.radio(
    "Repetition",
    ["top1", "overlap"] if RANKED else ["overlap"],
    horizontal=True,
    key="repetition_kind",
    format_func={"top1": "same top-1 expert", "overlap": "share ≥ 1 expert"}.get,
)
exports.show_chart(repetition_chart(repetition, kind), "repetition")
st.caption(
    "How often token t+1 repeats token t's routing. Baselines: uniform random routing (1/E for top-1; "
    "1 − C(E−k, k)/C(E, k) for overlap), and the layer's own routing shuffled across tokens (skewed load "
    "raises chance repetition). Observed well above the shuffled baseline = routing follows local context."
)
exports.table_downloads(repetition, "repetition")
share.reproduce(
    lambda: snippets.structure_view(
        share.snippet_input(source, chosen),
        layer,
        site,
        adjacent_only=bool(adjacent),
        top1=bool(top1),
        path_layers=hops if RANKED else None,
        at_scale=axis.at_scale,
    )
)
