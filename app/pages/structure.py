"""Structure: which experts fire together, how routing flows across layers, and along the text."""

import state
import streamlit as st

from moeviz.analysis import coactivation_frame, path_frame, repetition_frame, transition_frame
from moeviz.charts import coactivation_heatmap, path_chart, repetition_chart, transition_heatmaps

st.title("Structure")
source = state.model_picker()
trace = state.prompt_or_corpus_trace(source)
site, layer = state.pick_layer(trace)

st.subheader("Co-activation")
adjacent = st.toggle(
    "Rank-adjacent pairs only",
    key="coact_adjacent",
    help="Count only experts at consecutive ranks r, r+1 of S_t.",
)
coact = coactivation_frame(trace, adjacent_only=adjacent)
coact_layer = coact[(coact["layer"] == layer) & (coact["site"] == site)]
state.show_chart(coactivation_heatmap(coact_layer, title=f"Co-activation, layer {layer}"), "coactivation")
st.caption(
    "CoAct(i, j) = #{t : i, j ∈ S_t} / #{t : i ∈ S_t}: of the tokens sent to expert i (row), the share also "
    "sent to j. Not symmetric; the diagonal is left out. "
    + (
        "Rank-adjacent variant: only pairs at consecutive ranks count."
        if adjacent
        else "All pairs of S_t count."
    )
)
state.table_downloads(coact, "coactivation")

st.subheader("Across layers")
top1 = st.toggle("Top-1 only", key="transition_top1", help="Follow only each token's top-1 expert.")
transitions = transition_frame(trace, top1=top1)
if transitions.empty:
    st.info("Transitions need at least two MoE layers.")
else:
    state.show_chart(transition_heatmaps(transitions[transitions["site"] == site]), "transitions")
    st.caption(
        "T(i → j) = P(j ∈ S_t at the next layer | i ∈ S_t at this layer). Rows sum to k (set) or 1 (top-1); "
        "a bright single cell per row = a fixed pathway."
    )
    state.table_downloads(transitions, "transitions")

paths = path_frame(trace, top_n=15)
state.show_chart(path_chart(paths[paths["site"] == site]), "paths")
st.caption(
    "Top-1 expert of each MoE layer in order, e.g. 3→1→7; share = of tokens routed by all these layers."
)
state.table_downloads(paths.astype({"path": str, "layers": str}), "paths")

st.subheader("Along the text")
repetition = repetition_frame(trace)
kind = st.radio(
    "Repetition",
    ["top1", "overlap"],
    horizontal=True,
    key="repetition_kind",
    format_func={"top1": "same top-1 expert", "overlap": "share ≥ 1 expert"}.get,
)
state.show_chart(repetition_chart(repetition, kind), "repetition")
st.caption(
    "How often token t+1 repeats token t's routing. Baselines: uniform random routing (1/E for top-1; "
    "1 − C(E−k, k)/C(E, k) for overlap), and the layer's own routing shuffled across tokens (skewed load "
    "raises chance repetition). Observed well above the shuffled baseline = routing follows local context."
)
state.table_downloads(repetition, "repetition")
