"""About the model: the architecture facts the loaded model and its trace know."""

import state
import streamlit as st

from moeviz.architecture import bias_frame, layer_facts_frame, parameter_summary
from moeviz.charts import bias_chart

st.title("About the model")
source = state.model_picker()
trace = state.load_or_stop(source, st.session_state.get("prompt", state.EXAMPLE_PROMPT))
info = trace.model
facts = layer_facts_frame(trace)
first = facts.iloc[0] if len(facts) else None
params = parameter_summary(
    state.get_model(source).model,
    experts=None if first is None else int(first["experts"]),
    top_k=None if first is None else int(first["top_k"]),
)

st.caption(f"{info.architecture} ({info.model_type}) · {source} · {info.dtype}")
a, b, c, d = st.columns(4)
a.metric("Layers", info.num_layers, help="Transformer blocks")
b.metric("MoE layers", len(facts), help="Blocks with a router (the rest are dense)")
c.metric("Routed experts", params["experts"] or "?", help="E: experts per MoE layer a router chooses from")
d.metric("Top-k", params["top_k"] or "?", help="k: experts each token is sent to per MoE layer")
a, b, c, d = st.columns(4)
a.metric("Parameters", f"{params['total']:,}", help="Every weight of the model")
b.metric(
    "Active per token",
    f"{params['active']:,}" if params["active"] is not None else "?",
    help="total − routed × (1 − k/E): a token uses k of the E routed experts; shared experts, attention and "
    "embeddings always run",
)
c.metric("Active fraction", f"{params['active_fraction']:.0%}" if params["active_fraction"] else "?")
d.metric("Routed-expert parameters", f"{params['routed']:,}", help="Weights inside routed experts")

st.subheader("MoE layers")
st.dataframe(facts, hide_index=True)
st.caption(
    "score_fn: how router logits become scores (softmax over experts, or an independent sigmoid per expert); "
    "shared_experts: experts every token uses besides the routed ones; capacity: most tokens an expert may "
    "take per batch (None = unlimited, no token dropped); decision_source: where moeviz read the routing."
)
state.table_downloads(facts, "moe_layers")

bias = bias_frame(trace)
if bias.empty:
    st.caption("No balancing bias: experts are selected on the router scores alone.")
else:
    st.subheader("Balancing bias")
    state.show_chart(bias_chart(bias), "bias")
    st.caption(
        "Selection uses s_e + b_e (the weights still use s_e): an auxiliary-loss-free balancer raises b_e "
        "for underused experts and lowers it for overused ones during training (DeepSeek-V3)."
    )
    state.table_downloads(bias, "bias")
if info.notes:
    st.info("\n".join(info.notes))
