"""Structure: which experts fire together, how routing flows across layers, and along the text."""

import streamlit as st
from components import expert_axis, exports, pickers, prompt, scale_frames

from moeviz.analysis import (
    coactivation_frame,
    expert_balance_frame,
    expert_order,
    path_frame,
    repetition_frame,
    transition_frame,
)
from moeviz.charts import coactivation_heatmap, path_chart, repetition_chart, transition_heatmaps

st.title("Structure")
source = pickers.model_picker()
trace = prompt.prompt_or_corpus_trace(source)
site, layer = pickers.pick_layer(trace)
# Over 20 experts: one layer (pair) at a time, the top-N experts by load in the order chosen, all labelled.
SCALE = expert_axis.trace_at_scale(trace)
if SCALE:
    axis = expert_axis.expert_axis(
        expert_balance_frame(scale_frames.one_layer(trace, site, layer)),
        lambda: scale_frames.coactivation_counts(trace, site, layer),
    )

st.subheader("Co-activation")
adjacent = st.toggle(
    "Rank-adjacent pairs only",
    key="coact_adjacent",
    help="Count only experts at consecutive ranks r, r+1 of S_t.",
)
if SCALE:
    coact = coact_layer = scale_frames.coactivation(trace, site, layer, adjacent_only=adjacent)
    shown = scale_frames.filter_experts(coact_layer, axis.shown, "expert", "co_expert")
    chart = coactivation_heatmap(shown, title=f"Co-activation, layer {layer}")
    chart = expert_axis.sort_axis(chart, axis.shown, "x", "y")
    exports.show_chart(exports.many_marks(chart, len(shown)), "coactivation")
    st.caption(
        f"The {len(axis.shown)} busiest experts of this layer (top-N, and the chosen one), sorted by "
        f"{axis.order_name}; the download has all of them."
    )
else:
    coact = coactivation_frame(trace, adjacent_only=adjacent)
    coact_layer = coact[(coact["layer"] == layer) & (coact["site"] == site)]
    exports.show_chart(
        coactivation_heatmap(coact_layer, title=f"Co-activation, layer {layer}"), "coactivation"
    )
st.caption(
    "CoAct(i, j) = #{t : i, j ∈ S_t} / #{t : i ∈ S_t}: of the tokens sent to expert i (row), the share also "
    "sent to j. Not symmetric; the diagonal is left out. "
    + (
        "Rank-adjacent variant: only pairs at consecutive ranks count."
        if adjacent
        else "All pairs of S_t count."
    )
)
exports.table_downloads(coact, "coactivation")

st.subheader("Across layers")
top1 = st.toggle("Top-1 only", key="transition_top1", help="Follow only each token's top-1 expert.")
transitions = scale_frames.transitions(trace, site, layer, top1) if SCALE else transition_frame(trace, top1)
if transitions.empty:
    st.info(
        "Transitions need a next MoE layer: pick an earlier layer."
        if SCALE
        else "Transitions need at least two MoE layers."
    )
elif SCALE:  # the chosen layer → the next one, top-N experts on both sides
    following = int(transitions["next_layer"].iloc[0])
    ahead = expert_balance_frame(scale_frames.one_layer(trace, site, following))
    top = len(axis.shown)
    busiest = expert_order(ahead, by="load")[:top].tolist()
    ahead_ids = sorted(busiest) if axis.by == "id" else busiest
    shown = scale_frames.filter_experts(transitions, axis.shown, "expert")
    shown = shown[shown["next_expert"].isin(ahead_ids)]
    chart = expert_axis.sort_axis(transition_heatmaps(shown), axis.shown, "y")
    exports.show_chart(
        exports.many_marks(expert_axis.sort_axis(chart, ahead_ids, "x"), len(shown)), "transitions"
    )
    st.caption(
        f"Layer {layer} → {following}: rows = the experts shown above, columns = the {top} busiest experts "
        f"of layer {following} ({'by id' if axis.by == 'id' else 'busiest first'})."
    )
else:
    exports.show_chart(transition_heatmaps(transitions[transitions["site"] == site]), "transitions")
if not transitions.empty:
    st.caption(
        "T(i → j) = P(j ∈ S_t at the next layer | i ∈ S_t at this layer). Rows sum to k (set) or 1 (top-1); "
        "a bright single cell per row = a fixed pathway."
    )
    exports.table_downloads(transitions, "transitions")

paths = path_frame(trace, top_n=15)
exports.show_chart(path_chart(paths[paths["site"] == site]), "paths")
st.caption(
    "Top-1 expert of each MoE layer in order, e.g. 3→1→7; share = of tokens routed by all these layers."
)
exports.table_downloads(paths.astype({"path": str, "layers": str}), "paths")

st.subheader("Along the text")
repetition = repetition_frame(trace)
kind = st.radio(
    "Repetition",
    ["top1", "overlap"],
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
