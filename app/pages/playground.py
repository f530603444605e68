"""Routing playground: re-route the captured router logits of one layer with other settings (k, temperature,
capacity, balancing bias, score function) and see the dispatch, load and aux loss change at once; then
re-run the model with that routing forced. Every number comes from `moeviz.analysis.reroute`."""

import re

import pandas as pd
import streamlit as st
from components import caches, expert_axis, exports, page_input, pickers, presentation, prompt
from components.counterfactual import next_token_metrics
from components.errors import stop_on_error
from components.scale import at_scale

import moeviz
from moeviz.analysis.losses import AUX_LOSS_FORMS
from moeviz.analysis.reroute import RerouteSettings, max_k, parse_bias, reroute_layer
from moeviz.charts import router_score_heatmap
from moeviz.charts.attribution import position_delta_chart
from moeviz.charts.learn import aux_terms_compare_chart
from moeviz.interventions import ForceRouting, counterfactual

MAX_TOKENS = 200  # tokens of the dispatch heatmap
MAX_RERUN_TOKENS = 2048  # longer prompts: the re-run would hold the server
BIAS_COLUMNS = 4  # bias inputs per row: at 8, "expert 0" was cut to "exper / t 0" on a 900 px screen
SCORE_FUNCTIONS = ["softmax", "sigmoid"]
BIAS_WIDGET_KEY = re.compile(r"pg_bias_(\d+|table_\d+)")  # an input per expert, or the table at scale

st.title("Routing playground")
source = pickers.model_picker()
page_input.runs_the_model("The playground")  # a routing file chosen elsewhere: said, not used
text = prompt.prompt_form()
trace = caches.load_or_stop(source, text)
site, layer = pickers.pick_layer(trace)
routing = trace.layer(layer, site)
captured = RerouteSettings.captured(routing)
experts_n = routing.num_experts
AT_SCALE = at_scale(experts_n)  # over 20 experts: a bias table instead of an input per expert


def _defaults() -> dict:
    """The controls' values that reproduce the captured routing."""
    bias = [0.0] * experts_n if captured.bias is None else [float(b) for b in captured.bias]
    values = {
        "pg_k": captured.k,
        "pg_temperature": 1.0,
        "pg_score_fn": captured.score_fn,
        "pg_capacity_on": False,
        "pg_cf": 1.25,
        "pg_renormalise": captured.renormalise,
        "pg_groups": True,
        # a plain value, never a widget's: the bias table starts from it, whatever the page before drew
        "pg_start_bias": bias,
        # at scale the bias table is redrawn from those values under a new key (a fresh, unedited table)
        "pg_bias_version": st.session_state.get("pg_bias_version", 0) + 1,
    }
    if not AT_SCALE:  # one input per expert, each starting from its captured bias
        values.update({f"pg_bias_{e}": b for e, b in enumerate(bias)})
    return values


def _reset(values: dict) -> None:
    for key, value in values.items():
        st.session_state[key] = value


def _forget_bias_widgets() -> None:
    """Drop the bias widgets' values left by the page before (another model, layer or prompt): at 256 experts
    the 8-expert page's inputs are not drawn, and Streamlit would drop their values as stale widget state
    half-way through the next runs (a KeyError then); each page draws its own from "pg_start_bias"."""
    for key in [key for key in st.session_state if BIAS_WIDGET_KEY.fullmatch(str(key))]:
        del st.session_state[key]


def _start(values: dict) -> None:
    """Start from the captured routing on a new model, layer or prompt; on the same one, give any control
    whose value Streamlit dropped (a widget the last run did not draw) its captured value, keep the rest."""
    marker = (source, text, site, layer)
    if st.session_state.get("pg_for") != marker:
        _forget_bias_widgets()
        _reset(values)
        st.session_state["pg_for"] = marker
    for key, value in values.items():
        st.session_state.setdefault(key, value)


def teaching_point(question: str, answer: str) -> None:
    """A paradox the numbers beside it show, explained where it happens (drawn only when they show it)."""
    effect_area.info(f"**{question}** {answer}", icon=":material/lightbulb:")


_start(_defaults())

what = f"{captured.score_fn} → top-{captured.k}"
if captured.bias is not None:
    what += " on scores + balancing bias"
if routing.n_group and max_k(routing) < experts_n:
    what += f", within the best {routing.topk_group} of {routing.n_group} expert groups"
what += ", weights " + ("renormalised over the k" if captured.renormalise else "= the chosen scores")
if captured.scale != 1.0:
    what += f" × {captured.scale:g}"
st.caption(
    f"Layer {layer}: {experts_n} experts · captured routing: {what}. Start from it and change one thing."
)

# ---- controls ------------------------------------------------------------------------------------------
grouped = max_k(routing, group_limit=True) < experts_n
group_limit = bool(st.session_state.get("pg_groups", True)) if grouped else False
top = max_k(routing, group_limit)
st.session_state["pg_k"] = min(int(st.session_state["pg_k"]), top)
# the controls, and below them what they change; side by side in the projector layout (one screen)
controls_area, effect_area = presentation.beside([1, 2])
a, b, c, d = presentation.columns_or_stack(controls_area, 4)
with a:
    if top > 1:
        k = st.slider(
            "k: experts per token", 1, top, key="pg_k", help="How many experts each token is sent to"
        )
    else:
        k = 1
        st.caption("k = 1 (only one expert to choose from)")
temperature = b.slider(
    "Temperature",
    0.1,
    5.0,
    step=0.05,
    key="pg_temperature",
    help="The logits are divided by it before the score function: < 1 sharpens the scores, > 1 flattens them",
)
score_fn = c.radio(
    "Score function",
    SCORE_FUNCTIONS,
    key="pg_score_fn",
    horizontal=True,
    help=f"softmax: scores sum to 1 over the experts; sigmoid: each in (0, 1) on its own. "
    f"Captured: {captured.score_fn}",
)
with d:
    capacity_on = st.toggle("Expert capacity", key="pg_capacity_on", help="Off: no expert ever drops a token")
    cf = st.number_input(
        "Capacity factor",
        min_value=0.1,
        max_value=8.0,
        step=0.05,
        key="pg_cf",
        disabled=not capacity_on,
        help="C = ceil(T·k/E × factor) slots per expert and sequence; an over-full expert keeps its C "
        "largest weights (Megatron's probs policy) and drops the rest",
    )
e1, e2, e3 = presentation.columns_or_stack(controls_area, [2, 2, 1])
renormalise = e1.checkbox(
    "Renormalise the weights over the k", key="pg_renormalise", help="Else a weight is the expert's score"
)
if grouped:
    group_limit = e2.toggle(
        f"Group limit: best {routing.topk_group} of {routing.n_group} groups",
        key="pg_groups",
        help="DeepSeek-V3: a token first picks its best expert groups (by the sum of each group's two best "
        "scores + bias), then its k experts among them",
    )
e3.button("Reset", on_click=_reset, args=(_defaults(),), icon=":material/restart_alt:", key="pg_reset")


def _bias_inputs() -> list[float]:
    """One number input per expert, BIAS_COLUMNS to a row (two in the projector layout's narrow column)."""
    values = []
    per_row = 2 if presentation.projector() else BIAS_COLUMNS
    for start in range(0, experts_n, per_row):
        for column, e in zip(
            st.columns(per_row), range(start, min(start + per_row, experts_n)), strict=False
        ):
            values.append(column.number_input(f"expert {e}", step=0.01, format="%.3f", key=f"pg_bias_{e}"))
    return values


def _bias_table() -> list[object]:
    """At scale: one editable table (expert, bias) instead of hundreds of inputs. Each bias as typed (text
    the table could not read as a number reads back NaN; its edit state keeps what was typed)."""
    start = pd.DataFrame(
        {
            "expert": range(experts_n),
            "bias": [float(b) for b in st.session_state["pg_start_bias"]],
        }
    )
    key = f"pg_bias_table_{st.session_state['pg_bias_version']}"
    edited = st.data_editor(
        start,
        key=key,
        hide_index=True,
        disabled=["expert"],
        height=280,
        column_config={"bias": st.column_config.NumberColumn("bias", step=0.01, format="%.3f")},
    )
    typed: list[object] = edited["bias"].tolist()
    for row, change in (st.session_state.get(key) or {}).get("edited_rows", {}).items():
        if "bias" in change and 0 <= int(row) < experts_n:
            typed[int(row)] = change["bias"]
    return typed


with controls_area.expander(
    "Balancing bias per expert"  # the projector's narrow column: the rest is in the caption inside
    + ("" if presentation.projector() else " (added to the scores for the choice only, as in DeepSeek-V3)")
):
    bias_values = _bias_table() if AT_SCALE else _bias_inputs()
    st.caption(
        "Added to the scores for the choice only, as in DeepSeek-V3: a positive bias makes an expert more "
        "likely to be chosen; its weight stays its score."
    )
with stop_on_error():  # NaN, text or an empty cell: named by expert and value
    bias_values = parse_bias(bias_values, experts_n)
bias = None if captured.bias is None and not any(bias_values) else bias_values

settings = RerouteSettings(
    k=int(k),
    temperature=float(temperature),
    score_fn=score_fn,
    bias=bias,
    capacity_factor=float(cf) if capacity_on else None,
    renormalise=bool(renormalise),
    scale=captured.scale,
    group_limit=group_limit,
)
with stop_on_error():
    rerouted = reroute_layer(trace, layer, settings, site)

# ---- what changed ----------------------------------------------------------------------------------------
n_tokens = len(routing.token_rows)
# a row that wraps: four equal columns cut the values themselves ("0 of …") on a 900 px screen
metrics = effect_area.container(horizontal=True, gap="large")
metrics.metric("Tokens that changed experts", f"{rerouted.changed_tokens} of {n_tokens}", width="content")
metrics.metric(
    "Dropped slots",
    f"{rerouted.dropped_slots} of {n_tokens * k}",
    "no capacity" if rerouted.capacity is None else f"capacity C = {rerouted.capacity} per expert",
    delta_color="off",
    delta_arrow="off",
    width="content",
)
metrics.metric(
    "aux_loss_dispatched, re-routed",
    f"{rerouted.aux_loss_dispatched:.4f}",
    f"captured {rerouted.captured_aux_loss_dispatched:.4f}",
    delta_color="off",
    delta_arrow="off",
    help=f"{AUX_LOSS_FORMS['aux_loss_dispatched'].description} (unscaled): E·Σ f_e·P_e, f_e = share of "
    "tokens sent to expert e, P_e = its mean router probability",
    width="content",
)
metrics.metric(
    "aux_loss_dispatched under even load",
    f"{k}",
    f"captured {routing.k}",
    delta_color="off",
    delta_arrow="off",
    width="content",
)


if rerouted.drops_lower_aux_loss:
    teaching_point(
        "Why is the aux loss below its balanced value?",
        f"{rerouted.aux_loss_dispatched:.4f} < k = {k}, the value under even load: that is the drops. The "
        f"capacity dropped {rerouted.dropped_slots} slots and f_e counts only the dispatched ones, so "
        f"Σ_e f_e = k − dropped/T = {rerouted.dispatched_per_token:.4f}, not {k}. Drops lower the loss, "
        "balanced or not: read it beside the dropped slots.",
    )
if rerouted.temperature_keeps_choice:
    teaching_point(
        f"Why does temperature {temperature:g} move no token?",
        f"Dividing the logits by τ > 0 keeps their order, and {score_fn} grows with the logit, so every "
        f"token keeps its top-{k}. Only the scores change, and with them the weights and P: the aux loss "
        f"is {rerouted.aux_loss_dispatched:.4f} "
        f"(at τ = 1: {rerouted.at_temperature_one.aux_loss_dispatched:.4f}). "
        "A balancing bias added to the scores, a group limit or a capacity can make it change the choice.",
    )

captured_rows, rerouted_rows = rerouted.load_rows(captured=True), rerouted.load_rows()
# the experts the per-expert views list (over 20: the top-N by the captured load, and the chosen one)
axis = expert_axis.expert_axis(captured_rows)
left, right = effect_area.columns(2)
load_height = presentation.height("pg_load")
load_title = "Load" if presentation.projector() else "Expert load"  # a third of the page on a projector
for column, rows, dropped, title, key in (
    (left, captured_rows, None, f"{load_title}, captured (top-{routing.k})", "pg_load_captured"),
    (right, rerouted_rows, rerouted.dropped_slots, f"{load_title}, re-routed (top-{k})", "pg_load_rerouted"),
):
    with column:
        chart = expert_axis.load_chart(rows, axis, title=title, dropped=dropped)
        exports.show_chart(chart if load_height is None else chart.properties(height=load_height), key)
effect_area.caption(
    "Each expert's load against the fair share kT/E (1), busiest first; the chosen expert is marked."
    if axis.at_scale
    else "Tokens dispatched to each expert; dashed line = the fair share kT/E; grey = dropped by capacity."
)

if rerouted.bias_lowers_aux_loss_not_load:
    teaching_point(
        "Why does the aux loss fall while the load gets worse?",
        f"{rerouted.aux_loss_dispatched:.4f} against the captured "
        f"{rerouted.captured_aux_loss_dispatched:.4f}, "
        f"yet the busiest expert now takes {int(rerouted.load.max())} slots (captured "
        f"{int(rerouted.captured_load.max())}, fair share kT/E = {k * n_tokens / experts_n:.4g}). The bias "
        "only picks the experts: it moves f_e, but P_e, the mean router probability, comes from the scores "
        "without it. Sending tokens to experts of small P lowers E·Σ f_e·P_e however uneven f gets, so this "
        "loss cannot see a bias's imbalance (DeepSeek-V3 steers its bias by the load itself, not by a loss).",
    )

st.subheader("New dispatch per token")
heatmap = router_score_heatmap(
    rerouted.as_trace(trace).scores_frame(layer, site),
    max_tokens=MAX_TOKENS,
    title=f"Re-routed scores and dispatch, layer {layer}",
    selectable=False,
    experts=axis.shown,
)
exports.show_chart(
    exports.many_marks(
        expert_axis.sort_axis(heatmap, axis.shown), min(n_tokens, MAX_TOKENS) * len(axis.shown)
    ),
    "pg_dispatch",
)
expert_axis.caption_shown(axis, " under the captured routing")
st.caption(
    f"Colour = re-routed score = {score_fn}(logits / {temperature:g}); ● = where the token is now sent "
    "(dropped slots have no ●)."
)
tokens = rerouted.token_frame(trace)
changed = tokens[tokens["changed"]]
with st.expander(f"Tokens that changed experts ({len(changed)})"):
    st.dataframe(changed, hide_index=True)
    exports.table_downloads(tokens, "playground_tokens")

st.subheader("Auxiliary balancing loss, per expert")
terms = rerouted.aux_terms_frame()
exports.show_chart(
    aux_terms_compare_chart(
        terms, k=k, k_captured=routing.k, title=f"Terms E·f_e·P_e, layer {layer}: captured and re-routed"
    ),
    "pg_aux_terms",
)
st.caption(
    f"Each expert's term E·f_e·P_e; the terms sum to the aux loss. Under even load every f_e = k/E and the "
    f"loss is k ({k}); it grows when the experts that get the most tokens also get the most probability."
)
st.dataframe(
    terms,
    hide_index=True,
    column_config={name: st.column_config.NumberColumn(name, format="%.4f") for name in terms.columns[1:]},
)
exports.table_downloads(terms, "playground_aux_terms")

# ---- re-run ------------------------------------------------------------------------------------------
st.subheader("What the change does to the output")
prompt_tokens = trace.tokens[trace.tokens["seq"] == 0]
ids = [int(i) for i in prompt_tokens["token_id"]]
try:
    forced_experts, forced_weights = rerouted.forced()
except moeviz.MoevizError as exc:
    st.info(f"The model cannot run this routing as is: {exc}.", icon=":material/info:")
    forced_experts = None
if forced_experts is not None and len(prompt_tokens) > MAX_RERUN_TOKENS:
    st.info(
        f"The re-run takes prompts of up to {MAX_RERUN_TOKENS:,} tokens; this one has {len(prompt_tokens):,}."
    )
elif forced_experts is not None:
    spec = ForceRouting(layer=layer, experts=forced_experts, weights=forced_weights, site=site)
    key = (source, tuple(ids), site, layer, settings.key())
    if st.button("Re-run the model with this routing", type="primary", key="pg_rerun"):
        with st.status("Running the prompt with the captured and the new routing…") as status:
            try:
                run = counterfactual(caches.get_model(source), token_ids=ids, interventions=[spec])
                st.session_state["pg_rerun_result"] = (key, run)  # the latest only
                status.update(label="Done", state="complete")
            except moeviz.MoevizError as exc:
                status.update(label=str(exc), state="error")
    kept_key, run = st.session_state.get("pg_rerun_result", (None, None))
    if kept_key == key:
        next_token_metrics(
            run,
            mean_label="mean Δ log p(next token)",
            mean_help="Δ = log p_new(x_{t+1} | x_≤t) − log p_captured(x_{t+1} | x_≤t), mean over the "
            "prompt's positions",
            no_later="one token",
        )
        positions = run.position_frame()
        exports.show_chart(position_delta_chart(positions), "pg_positions")
        st.caption(
            "Δ log-prob of the prompt's actual next token at every position with the routing forced at this "
            "layer; orange: the token's experts changed at some MoE layer (later layers see changed inputs)."
        )
        exports.table_downloads(positions, "playground_logprobs")
    else:
        st.caption(
            "Forces the re-routed experts and weights at this layer (the other layers route as usual)."
        )
