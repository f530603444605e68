"""Why this expert? Attribution of a router's choice over the prompt, and what-if routing controls."""

import streamlit as st
from components import caches, expert_axis, exports, page_input, pickers, prompt
from components.counterfactual import next_token_metrics

import moeviz
from moeviz.analysis import expert_balance_frame, layer_trace
from moeviz.attribution import router_attribution
from moeviz.charts.attribution import attribution_strip_chart, importance_chart, position_delta_chart
from moeviz.charts.tables import token_options
from moeviz.interventions import DisableExpert, ForceExpert, NextBest, counterfactual, expert_importance

MAX_TOKENS = 2048  # longer prompts: minutes of attribution that would hold the server

st.title("Why this expert?")
source = pickers.model_picker()
page_input.runs_the_model("Why this expert?")  # a routing file chosen elsewhere: said, not used
prompt = prompt.prompt_form()
trace = caches.load_or_stop(source, prompt)
loaded = caches.get_model(source)
tokens = trace.tokens[trace.tokens["seq"] == 0]
if len(tokens) > MAX_TOKENS:
    st.info(
        f"This page explains prompts of up to {MAX_TOKENS:,} tokens; this one has {len(tokens):,}. "
        "Attribution runs dozens of forward and backward passes over the whole prompt (feature ablation "
        "one per token), and the expert sweep one forward per expert: shorten the prompt to use it.",
        icon=":material/info:",
    )
    st.stop()
options = token_options(tokens)  # the Routing page's labels: a token picked there stays picked here
# Explaining the first token explains nothing (it sees only itself): open on the last one unless a token
# was picked (here, on the Routing page, or by its link), also after a new prompt or another page's start.
if pickers.WHY_OPEN not in st.session_state:
    pickers.default_token(list(options), list(options)[-1])
_, pos = pickers.pick_token(options, None)
site, layer = pickers.pick_layer(trace)
routing = trace.layer(layer, site)
row = int(tokens.index[tokens["pos"] == pos][0])
layer_row = list(routing.token_rows).index(row)
chosen = [int(e) for e in routing.experts[layer_row] if e >= 0]
opened = st.session_state.pop(pickers.WHY_OPEN, None)  # reached from the Routing page's link
top = pickers.top_choice(routing, layer_row)
if opened == (0, pos):  # open on the clicked cell's expert if dispatched here, else the token's top-1
    start_expert, note = pickers.why_expert(routing, layer_row, opened)
    if start_expert is not None:
        pickers.set_expert(source, start_expert, as_default=start_expert == top)
        st.session_state["why_opened_note"] = (pos, site, layer, start_expert, note)
note = st.session_state.get("why_opened_note")
layer_load = expert_balance_frame(layer_trace(trace, layer, site))
# Unless chosen by hand on this model: the token's top choice (an expert kept from another page, prompt or
# model may be dead here); a token whose slots were all dropped: the layer's busiest.
pickers.default_expert(source, top if top is not None else pickers.busiest_expert(layer_load))
expert = expert_axis.pick_expert(layer_load, label=f"Expert (dispatched here: {chosen})")
if note is not None and note[:4] == (pos, site, layer, expert):  # until the token, layer or expert changes
    st.caption(note[4])
ids = [int(i) for i in tokens["token_id"]]
results = st.session_state.setdefault("why_results", {})

st.subheader("Which tokens drove the router?")
a, b, c = st.columns(3)
target = a.selectbox("Router value", ["score", "logit"], help="score: softmax/sigmoid probability")
baseline = b.selectbox(
    "Baseline", ["pad", "zero"], help="What a token is replaced by: the pad embedding or 0"
)
steps = c.select_slider("IG steps", [16, 32, 64, 128], value=32)
key = ("attr", source, tuple(ids), pos, site, layer, expert, target, baseline, steps)
if st.button("Explain", type="primary", key="why_explain"):
    with st.status("Integrated Gradients and feature ablation…") as status:
        try:
            results[key] = router_attribution(
                loaded,
                token_ids=ids,
                position=pos,
                layer=layer,
                site=site,
                expert=expert,
                target=target,
                baseline=baseline,
                n_steps=steps,
            )
            status.update(label="Attribution done", state="complete")
        except moeviz.MoevizError as exc:
            status.update(label=str(exc), state="error")
if key in results:
    res = results[key]
    x, y, z = st.columns(3)
    x.metric(f"router {target}", f"{res.value:.4f}", f"{res.value - res.baseline_value:+.4f} vs baseline")
    y.metric(
        "IG convergence delta",
        f"{res.delta:+.3g}",
        f"{res.relative_delta:.1%} of the difference",
        delta_color="off",
    )
    z.metric("IG vs ablation rank agreement", "—" if res.agreement is None else f"{res.agreement:.2f}")
    for message in res.warnings:
        st.warning(message + " Top-k switches along the path make MoE outputs non-smooth.")
    frame = res.frame()
    exports.show_chart(attribution_strip_chart(frame, title=res.what), "why_ig")
    exports.show_chart(
        attribution_strip_chart(frame, value="ablation", title="feature ablation"), "why_ablation"
    )
    exports.table_downloads(frame, "attribution")

st.subheader("What if?")
kind = st.radio(
    "Intervention",
    key="why_kind",
    options=[
        "Disable expert for this token",
        "Disable expert in this layer",
        "Disable expert everywhere",
        "Force this token to the expert",
        "Replace the top choice by the next-best",
    ],
)
specs = {
    "Disable expert for this token": DisableExpert(expert=expert, layer=layer, positions=pos, site=site),
    "Disable expert in this layer": DisableExpert(expert=expert, layer=layer, site=site),
    "Disable expert everywhere": DisableExpert(expert=expert),
    "Force this token to the expert": ForceExpert(expert=expert, layer=layer, positions=pos, site=site),
    "Replace the top choice by the next-best": NextBest(layer=layer, positions=pos, site=site),
}
cf_key = ("cf", source, tuple(ids), kind, pos, site, layer, expert)
if st.button("Run what-if", key="why_whatif"):
    with st.status("Running the prompt with and without the intervention…") as status:
        try:
            results[cf_key] = counterfactual(loaded, token_ids=ids, interventions=[specs[kind]])
            status.update(label="Done", state="complete")
        except moeviz.MoevizError as exc:
            status.update(label=str(exc), state="error")
if cf_key in results:
    cf = results[cf_key]
    positions = cf.position_frame()
    first = cf.first_intervened
    next_token_metrics(
        cf,
        mean_label=f"mean Δ log p(next token), positions ≥ {first}",
        mean_help="Δ = log p_after(x_{t+1} | x_≤t) − log p_before(x_{t+1} | x_≤t) at every position t from "
        "the intervened one on (earlier positions cannot see the intervention: Δ = 0 there).",
        no_later="no later position",
    )
    exports.show_chart(position_delta_chart(positions), "why_positions")
    st.caption(
        "Δ log-prob of the prompt's actual next token at every position; orange: the token's dispatched "
        "experts changed at some MoE layer (see the table below)."
    )
    st.dataframe(cf.layer_summary(), hide_index=True)
    changes = cf.routing_changes()
    st.caption("Tokens whose dispatched experts changed (later layers and later tokens):")
    st.dataframe(changes[changes["changed"]], hide_index=True)
    exports.table_downloads(positions, "whatif_logprobs")

st.subheader("Expert importance over the prompt")
imp_key = ("imp", source, tuple(ids))
if st.button("Disable each expert in turn", key="why_importance_run"):
    bar = st.progress(0.0, text="Disabling experts…")
    try:
        results[imp_key] = expert_importance(
            loaded, token_ids=ids, progress=lambda f, t: bar.progress(f, text=t)
        )
    except moeviz.MoevizError as exc:
        st.error(str(exc))
    bar.empty()
if imp_key in results:
    exports.show_chart(importance_chart(results[imp_key]), "why_importance")
    exports.table_downloads(results[imp_key], "expert_importance")
