"""Routing: which experts each token of a prompt was sent to, layer by layer."""

import state
import streamlit as st

from moeviz.analysis import expert_load_frame, layer_summary_frame
from moeviz.charts import expert_load_chart, router_score_heatmap, token_window

MAX_TOKENS = 400  # tokens per heatmap window

st.title("Routing")
source = state.model_picker()

with st.form("prompt_form"):
    text = st.text_area("Prompt", value=state.EXAMPLE_PROMPT, key="routing_prompt", height=100)
    st.form_submit_button("Analyse", type="primary", help="Or press Ctrl+Enter in the prompt")

trace = state.load_or_stop(source, text)
keys = trace.layer_keys
if not keys:
    st.warning("The model routed no token through an MoE layer.")
    st.stop()

layers = state.layer_options(keys)  # label -> (site, layer)
state.remember("routing_layer_widget", "routing_layer", list(layers))
st.session_state["routing_layer"] = st.select_slider("MoE layer", list(layers), key="routing_layer_widget")
site, layer = layers[st.session_state["routing_layer"]]

scores = trace.scores_frame(layer, site)
num_tokens = int(scores["row"].nunique())
summary = layer_summary_frame(trace).set_index(["site", "layer"]).loc[(site, layer)]
st.caption(
    f"{trace.model.architecture} · {len(trace.tokens)} tokens · {len(keys)} MoE layers · "
    f"{int(summary['experts'])} experts, top-{int(summary['top_k'])}"
)

start = 0
if num_tokens > MAX_TOKENS:
    start = st.slider("First token shown", 0, num_tokens - MAX_TOKENS, 0, step=max(MAX_TOKENS // 4, 1))
lo, hi = token_window(num_tokens, max_tokens=MAX_TOKENS, start=start)

with st.container(key="heatmap"):
    st.altair_chart(
        router_score_heatmap(scores, max_tokens=MAX_TOKENS, start=lo, title=f"Router scores, layer {layer}"),
        width="stretch",
    )
st.caption(
    f"Colour = router score = {trace.layer(layer, site).score_fn}(router logits), before top-k. "
    "● = expert the token was dispatched to; hover a cell for its logit and the combination weight the "
    "model used (0 where not dispatched)."
)

load = expert_load_frame(trace).query("layer == @layer and site == @site")
left, right = st.columns([3, 2])
with left, st.container(key="load"):
    st.altair_chart(expert_load_chart(load, title=f"Expert load, layer {layer}"), width="stretch")
with right:
    a, b, c = st.columns(3)
    a.metric("Load entropy", f"{summary['load_entropy']:.2f}", help="H(load) / log E; 1 = perfectly even")
    b.metric("Max share", f"{summary['max_share']:.0%}", help=f"Fair share is {1 / summary['experts']:.0%}")
    c.metric("Dead experts", int(summary["dead_experts"]), help="Experts that received no token")
    st.caption(
        "Bars: tokens dispatched to each expert in this layer (a token counts once per expert it uses). "
        "Dashed line: the fair share, what every expert would get if the load were even."
    )
    d1, d2 = st.columns(2)
    # Files are built only when clicked; a click does not rerun the page.
    d1.download_button(
        "Routing table (CSV)",
        state.routing_csv(trace),
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
