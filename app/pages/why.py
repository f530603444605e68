"""Why this expert? Attribution of a router's choice over the prompt, and what-if routing controls."""

import streamlit as st
from components import caches, expert_axis, exports, page_input, pickers, prompt, share
from components.counterfactual import cost_line, forward_timing, next_token_metrics, progress_bar

import moeviz
from moeviz import snippets
from moeviz.analysis import expert_balance_frame, layer_trace
from moeviz.attribution import router_attribution
from moeviz.charts.attribution import attribution_strip_chart, importance_chart, position_delta_chart
from moeviz.charts.tables import token_options
from moeviz.interventions import DisableExpert, ForceExpert, NextBest, counterfactual, expert_importance
from moeviz.interventions.cost import importance_cost, whatif_cost
from moeviz.interventions.counterfactual import busiest_experts, importance_plan, no_effect_reason

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
timing = forward_timing(source, loaded, ids)
no_effect = no_effect_reason(trace, [specs[kind]])  # read from the routing on screen: no forward
whatif_row = st.container(horizontal=True, vertical_alignment="center")
run_whatif = whatif_row.button("Run what-if", key="why_whatif", disabled=no_effect is not None)
whatif_row.caption(
    f"Nothing to run: {no_effect}." if no_effect else cost_line(whatif_cost(timing, len(ids)), timing)
)
if run_whatif:
    with st.status("Running the prompt with and without the intervention…") as status:
        update, bar = progress_bar("Running the prompt…")
        try:
            results[cf_key] = counterfactual(
                loaded, token_ids=ids, interventions=[specs[kind]], trace=trace, progress=update
            )
            status.update(label="Done", state="complete")
        except moeviz.MoevizError as exc:
            status.update(label=str(exc), state="error")
        bar.empty()
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
moe_layers = sorted({r.layer for r in trace.layers})
num_experts = max(r.num_experts for r in trace.layers)
a, b, c = st.columns([2, 2, 1])
span = (
    a.select_slider("MoE layers", moe_layers, value=(moe_layers[0], moe_layers[-1]), key="why_imp_layers")
    if len(moe_layers) > 1
    else (moe_layers[0], moe_layers[0])
)
sweep_layers = [x for x in moe_layers if span[0] <= x <= span[1]]
EVERY, BUSIEST = "every expert dispatched on the prompt", "the busiest N per layer"
choice = b.radio(
    "Experts",
    [EVERY, BUSIEST],
    index=1 if num_experts > 64 else 0,  # hundreds of experts: a sweep of every one runs for hours
    key="why_imp_experts",
    help="An expert no token of the prompt is sent to cannot change the loss: it is never disabled.",
)
busiest_n = int(c.number_input("N", 1, num_experts, 8, key="why_imp_n", disabled=choice != BUSIEST))
sweep_experts = busiest_experts(trace, busiest_n, sweep_layers) if choice == BUSIEST else None
plans = importance_plan(loaded.sites, trace, layers=sweep_layers, experts=sweep_experts)
sweep_cost = importance_cost(timing, len(ids), [len(p.measured) for p in plans])
measured = sum(len(p.measured) for p in plans)
imp_key = ("imp", source, tuple(ids), tuple(sweep_layers), choice, busiest_n if choice == BUSIEST else 0)
imp_row = st.container(horizontal=True, vertical_alignment="center")
run_importance = imp_row.button(
    "Disable each expert in turn", key="why_importance_run", disabled=not measured
)
imp_row.caption(
    f"{len(sweep_layers)} of {len(moe_layers)} MoE layers × {choice.replace(' N ', f' {busiest_n} ')}: "
    f"{measured:,} (layer, expert) pairs. " + cost_line(sweep_cost, timing)
)
if run_importance:
    update, bar = progress_bar("Disabling experts…")
    try:
        results[imp_key] = expert_importance(
            loaded, token_ids=ids, layers=sweep_layers, experts=sweep_experts, progress=update
        )
    except moeviz.MoevizError as exc:
        st.error(str(exc))
    bar.empty()
if imp_key in results:
    exports.show_chart(importance_chart(results[imp_key]), "why_importance")
    exports.table_downloads(results[imp_key], "expert_importance")
share.reproduce(
    lambda: snippets.why_view(
        share.snippet_input(source, text=prompt),
        pos,
        layer,
        site,
        expert,
        target=target,
        baseline=baseline,
        steps=steps,
        intervention=share.WHY_INTERVENTIONS.get(kind, kind),
    )
)
