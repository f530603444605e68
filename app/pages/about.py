"""About the model: the architecture facts the loaded model and its trace know — or, for a routing file, the
routing facts the file records."""

import streamlit as st
from components import caches, exports, load_options, page_input, pickers
from components.scale import trace_at_scale

from moeviz.analysis import balance_frame
from moeviz.architecture import (
    bias_frame,
    dense_layers,
    group_limit,
    layer_facts_frame,
    parameter_summary,
    scaling_summary,
)
from moeviz.charts import bias_chart, layer_expert_heatmap
from moeviz.models.adapters import AdapterInfo, adapted_modules_frame
from moeviz.models.memory import format_bytes

st.title("About the model")
source = pickers.model_picker()
chosen = page_input.page_input(source, form=False)
trace = page_input.trace_or_stop(chosen, "the routing of each MoE layer (per-token routing)")
info = trace.model
facts = layer_facts_frame(trace)
first = facts.iloc[0] if len(facts) else None


def file_facts() -> None:
    """A routing file's facts: the model it names, its MoE layers and what it records of each."""
    st.caption(f"{info.architecture} ({info.model_type}) · {info.source} · {chosen.label}")
    a, b, c, d = st.columns(4)
    a.metric("Layers", info.num_layers, help="Transformer blocks of the model the file names")
    b.metric("MoE layers", len(facts), help="Layers the file holds routing of")
    c.metric("Routed experts", int(first["experts"]) if first is not None else "?")
    d.metric("Top-k", int(first["top_k"]) if first is not None else "?")
    st.caption(
        "Parameters, precision and memory are facts of a loaded model: choose this model on the prompt "
        "(above) to see the sidebar model's."
    )
    st.subheader("MoE layers")
    recorded = facts.assign(
        router_scores=[r.has_logits for r in trace.layers],
        weights=[r.has_weights for r in trace.layers],
        ranked=[r.ranked for r in trace.layers],
    )
    st.dataframe(recorded, hide_index=True)
    st.caption(
        "decision_source: where the routing came from (an import format, or how moeviz captured it); "
        "router_scores, weights: whether the file records the router's logits and the combination weights "
        "(an engine import often records only the chosen experts); ranked: whether slot 0 is the top choice "
        "(False: each token's experts in id order)."
    )
    exports.table_downloads(recorded, "moe_layers")
    if bias_frame(trace).empty:
        st.caption("The file records no balancing bias.")


if chosen.from_file:
    file_facts()
    st.stop()
loaded = caches.get_model(source)
facts = layer_facts_frame(trace, loaded.model.config)  # the config: the routed scaling weights may hide
params = parameter_summary(
    loaded.model,
    experts=None if first is None else int(first["experts"]),
    top_k=None if first is None else int(first["top_k"]),
)

model_source, options = load_options.split_key(source)
loaded_with = f" · loaded with {options.label()}" if options.changed() else ""
text_model = f" · text model captured: {info.language_model}" if info.language_model else ""
st.caption(
    f"{info.architecture} ({info.model_type}) · {model_source} · {info.dtype}{loaded_with}{text_model}"
)
a, b, c, d = st.columns(4)
a.metric("Layers", info.num_layers, help="Transformer blocks")
b.metric("MoE layers", len(facts), help="Blocks with a router (the rest are dense)")
c.metric("Routed experts", params["experts"] or "?", help="E: experts per MoE layer a router chooses from")
d.metric("Top-k", params["top_k"] or "?", help="k: experts each token is sent to per MoE layer")
# model cards differ on the input embedding (a token reads one row of it): say that it is counted
embedding = params["active"] is not None and params["input_embedding"] > 0
a, b, c, d = st.columns(4)
a.metric("Parameters", f"{params['total']:,}", help="Every weight of the model")
b.metric(
    "Active per token",
    f"{params['active']:,}" if params["active"] is not None else "?",
    help="total − routed × (1 − k/E): a token uses k of the E routed experts; shared experts, attention and "
    "embeddings always run"
    + (" (the input embedding too: the line below gives the count without it)" if embedding else ""),
)
c.metric("Active fraction", f"{params['active_fraction']:.0%}" if params["active_fraction"] else "?")
d.metric("Routed-expert parameters", f"{params['routed']:,}", help="Weights inside routed experts")
if embedding:
    st.caption(
        f"Active per token counts the input embedding ({params['input_embedding']:,} parameters), although a "
        f"token reads one row of it; without it, {params['active_without_input_embedding']:,}. Model cards "
        "differ: gpt-oss's published 5.1 B active leaves it out, Mixtral's 12.9 B counts it."
    )
dense = dense_layers(trace)
zero = facts["zero_experts"].max() if len(facts) else 0
# side by side at their own width, wrapping on a narrow page: "best 4 of 8 groups" is never cut
row = st.container(horizontal=True, gap="large")
row.metric(
    "Dense layers",
    ", ".join(map(str, dense)) if dense else "none",
    help="Layers without a router (dense-first layers, or the dense half of an interleaved model)",
    width="content",
)
row.metric(
    "Group limit",
    group_limit(facts),
    help="Group-limited routing (DeepSeek-V3, Kimi-K2): the experts are split into n_group groups and each "
    "token chooses its k experts among the experts of its best topk_group groups only. Per layer: the "
    "n_group and topk_group columns of the table below.",
    width="content",
)
row.metric(
    "Routed scaling",
    scaling_summary(facts),
    help="The routed scaling factor: the routed experts' combination weights are multiplied by it "
    "(DeepSeek-V3: 2.5). Read off the captured weights where every token's weights sum to the same value, "
    "else the config's routed_scaling_factor. Per layer: the routed_scaling column of the table below.",
    width="content",
)
if zero:
    skipped = balance_frame(trace)["skipped_fraction"].mean()
    row.metric(
        "Zero-computation experts",
        f"{zero} · {skipped:.1%} of slots",
        help="Experts that compute nothing (identity or skip) beside the routed ones; the share of this "
        "prompt's expert slots that went to them is compute the router skipped. Loads, dead experts and "
        "balance count only the routed experts.",
        width="content",
    )

adapter = AdapterInfo.from_json(loaded.info.adapter)
if adapter is not None:
    adapted = adapted_modules_frame(adapter, loaded.model, loaded.sites)
    st.subheader("Adapter")
    a, b, c, d = st.columns(4)
    a.metric("Type", "LoRA", help="A PEFT adapter, merged into the weights at load: this is the fine-tune")
    b.metric("Rank r", adapter.rank, help="Each update is B·A, B [out, r] and A [r, in]")
    c.metric(
        "Alpha",
        f"{adapter.alpha:g}",
        help=f"The update is scaled by alpha/r = {adapter.alpha / adapter.rank:g}",
    )
    d.metric("Modules adapted", len(adapted))
    kinds = adapted["kind"].value_counts()
    st.caption(
        f"Targets (its adapter_config.json): modules {', '.join(adapter.target_modules) or 'none'}; "
        f"parameters {', '.join(adapter.target_parameters) or 'none'}. Adapted: "
        + ", ".join(f"{n} {kind}" for kind, n in kinds.items())
        + f". Folder: {adapter.path}."
    )
    with st.expander("Adapted modules"):
        st.dataframe(adapted, hide_index=True)

st.subheader("Precision, device and memory")
a, b, c, d = st.columns(4)
a.metric("dtype", loaded.info.dtype, help="The dtype the weights were loaded at (Advanced in the sidebar)")
b.metric("Device", loaded.info.device, help="Where the model sits; with a device map, each device's modules")
c.metric(
    "Parameter bytes",
    format_bytes(loaded.info.parameter_bytes),
    help=f"{loaded.info.parameter_bytes:,} bytes of parameters and buffers at {loaded.info.dtype}",
)
memory = loaded.memory
if memory is not None:
    free = "unknown" if memory.available_bytes is None else format_bytes(memory.available_bytes)
    d.metric(
        "Fits in memory",
        "yes" if memory.fits else "no",
        help=f"Parameters + activations for {memory.activation_tokens:,} tokens against the free memory of "
        f"{memory.device}",
    )
    st.caption(
        f"Load-time memory estimate on {memory.device} at {memory.dtype}: "
        f"{format_bytes(memory.parameter_bytes)} of parameters + {format_bytes(memory.activation_bytes)} "
        f"of activations for {memory.activation_tokens:,} tokens = "
        f"{format_bytes(memory.total_bytes)}; free: {free}."
    )
if loaded.info.notes:
    st.info("\n".join(loaded.info.notes))

st.subheader("MoE layers")
st.dataframe(facts, hide_index=True)
st.caption(
    "score_fn: how router logits become scores (softmax over experts, or an independent sigmoid or "
    "sqrt-softplus per expert); selection: what the top-k was taken on (a hash table: a fixed token-id → "
    "experts table, the scores only weight the chosen experts); zero_experts: experts that compute nothing, "
    "beside the routed ones; n_group, topk_group: the group limit (each token chooses among the experts of "
    "its best topk_group of n_group groups; None = no limit); routed_scaling: the factor the routed "
    "experts' weights are multiplied by (read off the weights where every token's weights share one sum, "
    "else the config's; None = neither tells); shared_experts: experts every token uses besides the routed "
    "ones; capacity: "
    "most tokens an expert may take per batch (None = unlimited, no token dropped); decision_source: where "
    "moeviz read the routing; block and pass: a looped block runs once per pass, each pass its own layer."
)
exports.table_downloads(facts, "moe_layers")

bias = bias_frame(trace)
if bias.empty:
    st.caption("No balancing bias: experts are selected on the router scores alone.")
else:
    st.subheader("Balancing bias")
    if trace_at_scale(trace):  # hundreds of experts × dozens of layers: one heatmap
        heatmap = layer_expert_heatmap(bias, "bias", title="Balancing bias per layer and expert")
        exports.show_chart(exports.many_marks(heatmap, len(bias)), "bias")
    else:
        exports.show_chart(bias_chart(bias), "bias")
    st.caption(
        "Selection uses s_e + b_e (the weights still use s_e): an auxiliary-loss-free balancer raises b_e "
        "for underused experts and lowers it for overused ones during training (DeepSeek-V3)."
    )
    exports.table_downloads(bias, "bias")
