"""Learn: a guided lesson in short steps, one screen each, on the bundled samples. Every number is measured
on one fixed text (`components.learn.LESSON_TEXT`) routed through the sample models, or on the user's own
text ("Use my own text", steps 1–7) through the same cached captures as the other pages; step 8 reads a
small fine-tuning run shipped with the samples (`components.learn_finetune`)."""

import pandas as pd
import streamlit as st
from components import caches, exports, presentation, share
from components import learn as lesson_ui
from components import learn_finetune as finetune_lesson
from components.widgets import kept

from moeviz.analysis import balance_stats, expert_balance_frame
from moeviz.analysis.lesson import (
    aux_notice,
    bias_contrast_layer,
    bias_effect,
    bias_layers,
    bias_notice,
    collapse_contrast_layer,
    collapse_layers,
    collapse_notice,
    expert_parameters,
    expert_token_share,
    largest_aux_layer,
    load_notice,
    most_uneven_layer,
    router_notice,
    router_walkthrough,
    shared_fraction,
    shared_notice,
    sweep_notice,
    token_weights_frame,
    top_k_notice,
)
from moeviz.analysis.losses import bias_stats
from moeviz.analysis.reroute import RerouteSettings, aux_terms, reroute
from moeviz.architecture import parameter_summary
from moeviz.charts import expert_load_chart, token_options
from moeviz.charts.finetune_lesson import LESSON_METRICS, finetune_lesson_chart, mode_colours
from moeviz.charts.learn import (
    aux_terms_chart,
    choice_load_chart,
    experts_sweep_chart,
    load_side_by_side_chart,
    router_walkthrough_chart,
    shared_experts_chart,
    token_weights_chart,
)

TEXT = lesson_ui.LESSON_TEXT  # or the user's (`lesson_ui.lesson_text`), set before the step is drawn
WEIGHT_TOKENS = 24  # tokens drawn in the top-1 vs top-2 step


def trace_of(source: str):
    return caches.load_or_stop(source, TEXT)


def notice(text: str) -> None:
    """The step's one "what to notice" line (shortened in the projector layout: `lesson_ui.notice`)."""
    lesson_ui.notice(text)


def beside():
    """Two columns: a step's chart (left) and its numbers stacked beside it (right), so that a step fits one
    1280 × 720 screen."""
    return st.columns([3, 1], vertical_alignment="center", gap="medium")


def pick_layer(trace, store_key: str, where, default: tuple[str, int] | None = None) -> tuple[str, int]:
    """A layer slider of its own per step (kept across page switches), drawn in `where` → (site, layer);
    it opens on `default` (the layer where the step's point shows most), the first layer without one."""
    layers = {str(layer): (site, layer) for site, layer in trace.layer_keys}
    if default is not None:
        st.session_state.setdefault(store_key, str(default[1]))
    with where:
        return layers[kept(store_key, list(layers), st.select_slider, "MoE layer", list(layers))]


# ---- 1 -------------------------------------------------------------------------------------------------
def router_step() -> None:
    control = lesson_ui.step_heading("1 · What a router computes")
    trace = trace_of(lesson_ui.HEALTHY)
    site, layer = trace.layer_keys[0]
    routing = trace.layer(layer, site)
    options = token_options(trace.tokens)
    with control:
        label = kept("learn_token", list(options), st.selectbox, "Token", list(options))
    row = lesson_ui.layer_row(trace, site, layer, *options[label])
    walk = router_walkthrough(routing, row)
    chosen = walk[walk["chosen"]].sort_values("rank")
    notice(router_notice(walk, routing.num_experts))
    exports.show_chart(
        router_walkthrough_chart(
            walk,
            k=routing.k,
            score_fn=routing.score_fn,
            title=f"Token {label} at MoE layer {layer}",
            row_height=presentation.height("learn_router_row"),
        ),
        "learn_router",
    )
    lesson_ui.details(
        f"{lesson_ui.HEALTHY}, MoE layer {layer}. ① the router's logits, one per expert (a linear layer "
        f"of the token's hidden state); ② p = {routing.score_fn}(logits); ③ the top-{routing.k} kept and "
        f"renormalised, w_e = p_e / Σ_chosen p. The model's own combination weights: "
        + ", ".join(f"{r.model_weight:.3f}" for r in chosen.itertuples())
        + "."
    )


# ---- 2 -------------------------------------------------------------------------------------------------
def top_k_step() -> None:
    control = lesson_ui.step_heading("2 · Top-1 vs top-2")
    trace = trace_of(lesson_ui.HEALTHY)
    site, layer = trace.layer_keys[0]
    routing = trace.layer(layer, site)
    st.session_state.setdefault("learn_k", routing.k)  # the model's own k first
    with control:
        k = int(
            kept(
                "learn_k",
                [1, 2],
                st.segmented_control,
                "Experts per token (k)",
                [1, 2],
                format_func=lambda v: f"top-{v}",
                required=True,
            )
        )
    rerouted = reroute(routing, RerouteSettings(k=k, score_fn=routing.score_fn))
    stats = balance_stats(rerouted.as_layer_routing())
    notice(
        top_k_notice(rerouted.weights, stats.max_share, stats.tokens, routing.num_experts, judge_length=True)
    )
    left, right = st.columns([3, 2])
    with left:
        frame = token_weights_frame(trace.tokens, routing, rerouted.experts, rerouted.weights, WEIGHT_TOKENS)
        exports.show_chart(
            token_weights_chart(
                frame,
                title=f"Top-{k}: the first {WEIGHT_TOKENS} tokens",
                height=presentation.height("learn_weights"),
            ),
            "learn_weights",
        )
    with right:
        exports.show_chart(
            expert_load_chart(rerouted.load_rows(), title=f"Load with top-{k}").properties(
                height=presentation.height("learn_k_load")
            ),
            "learn_k_load",
        )
    lesson_ui.details(
        f"The captured router scores of MoE layer {layer} ({lesson_ui.HEALTHY}, trained with top-2) routed "
        f"again with top-{k}, weights renormalised over the chosen experts. Dashed line: the fair share kT/E."
    )


# ---- 3 -------------------------------------------------------------------------------------------------
def load_step() -> None:
    control = lesson_ui.step_heading("3 · Expert load and the fair share")
    trace = trace_of(lesson_ui.HEALTHY)
    site, layer = pick_layer(trace, "learn_load_layer", control, most_uneven_layer(trace))
    rows = expert_balance_frame(trace)
    load = rows[(rows["site"] == site) & (rows["layer"] == layer)]
    fair = 1 / len(load)
    stats = balance_stats(trace.layer(layer, site))
    notice(load_notice(load, layer, tokens=stats.tokens, k=stats.top_k))
    chart, metrics = beside()
    with chart:
        exports.show_chart(
            expert_load_chart(load, title=f"Expert load, MoE layer {layer}").properties(
                height=presentation.height("learn_load")
            ),
            "learn_load",
        )
    metrics.metric("Fair share 1/E", f"{fair:.1%}", width="content")
    metrics.metric("Busiest expert", f"{stats.max_share:.1%}", width="content")
    metrics.metric(
        "Load entropy",
        f"{stats.load_entropy:.3f}",
        help="H(load) / log E: 1 = perfectly even",
        width="content",
    )
    metrics.metric("Dead experts", stats.dead_experts, help="Experts that got no token", width="content")
    lesson_ui.details(
        f"{lesson_ui.HEALTHY}, {stats.tokens} tokens × k = {stats.top_k} slots. Bars: tokens sent to each "
        "expert (a token counts once per expert it uses); dashed line: the fair share kT/E (= 1/E of the "
        "slots)."
    )


# ---- 4 -------------------------------------------------------------------------------------------------
def aux_loss_step() -> None:
    control = lesson_ui.step_heading("4 · The auxiliary balancing loss")
    trace = trace_of(lesson_ui.HEALTHY)
    site, layer = pick_layer(trace, "learn_aux_layer", control, largest_aux_layer(trace))
    routing = trace.layer(layer, site)
    terms = aux_terms(routing)
    loss = float(terms["term"].sum())
    k = routing.k
    notice(aux_notice(terms, k, layer, tokens=len(routing.token_rows)))
    chart, metrics = beside()
    with chart:
        exports.show_chart(
            aux_terms_chart(
                terms,
                k=k,
                title=f"Terms E·f_e·P_e, MoE layer {layer}",
                height=presentation.height("learn_aux"),
            ),
            "learn_aux",
        )
    metrics.metric(
        "Aux loss L, top-k form",
        f"{loss:.4f}",
        help="aux_loss_topk: E · Σ_e f_e · P_e, unscaled (α = 1)",
        width="content",
    )
    metrics.metric("Balanced value", f"{k}", help="L under perfectly even load (f_e = k/E)", width="content")
    metrics.metric("L ÷ balanced", f"{loss / k:.3f}", width="content")
    lesson_ui.details(
        "Switch / GShard auxiliary loss in its top-k form (transformers' load_balancing_loss_func): f_e = "
        "share of tokens whose top-k includes e (not divided by k), P_e = mean router probability of e. "
        "Training adds α·L (α ≈ 0.01) to the language-model loss; its gradient (through P) pushes "
        f"probability away from overloaded experts. Replayed from the captured router of {lesson_ui.HEALTHY} "
        "(trained with α = 0.01, per layer)."
    )


# ---- 5 -------------------------------------------------------------------------------------------------
def collapse_step() -> None:
    control = lesson_ui.step_heading("5 · Collapse")
    traces = {name: trace_of(source) for name, source in lesson_ui.COLLAPSE_SAMPLES.items()}
    contrast = collapse_layers(traces)  # per layer and model: busiest, entropy, dead
    site, layer = pick_layer(
        traces["healthy"], "learn_collapse_layer", control, collapse_contrast_layer(contrast)
    )
    parts, stats = [], {}
    for name, trace in traces.items():
        rows = expert_balance_frame(trace)
        parts.append(rows[(rows["site"] == site) & (rows["layer"] == layer)].assign(model=name))
        stats[name] = balance_stats(trace.layer(layer, site))
    load = pd.concat(parts, ignore_index=True)
    healthy = stats["healthy"]
    notice(
        collapse_notice(contrast, site, layer, len(healthy.counts), tokens=healthy.tokens, k=healthy.top_k)
    )
    chart, numbers = presentation.beside([3, 1])  # on a projector the entropies stand beside the panels
    with chart:
        exports.show_chart(
            load_side_by_side_chart(
                load,
                title=f"Load per expert, MoE layer {layer}",
                height=presentation.height("learn_collapse"),
            ),
            "learn_collapse",
        )
    metrics = numbers.container(horizontal=not presentation.projector(), gap="large")
    for name, s in stats.items():
        metrics.metric(
            f"{name}: load entropy",
            f"{s.load_entropy:.2f}",
            help=f"H(load) / log E (1 = even); {s.dead_experts} dead experts",
            width="content",
        )
    lesson_ui.details(
        "mixtral-healthy: trained with the balancing loss; mixtral-unbalanced: without it (a few hub "
        "experts); mixtral-collapsed: trained with a loss that rewards imbalance. The Load & collapse page "
        "gives the verdicts on a longer text."
    )


# ---- 6 -------------------------------------------------------------------------------------------------
def bias_step() -> None:
    control = lesson_ui.step_heading("6 · Balancing with a bias")
    trace = trace_of(lesson_ui.BIASED)
    default = bias_contrast_layer(bias_layers(trace))  # where the bias evens the load most
    site, layer = pick_layer(trace, "learn_bias_layer", control, default)
    routing = trace.layer(layer, site)
    # the same router (its group limit and weight rule) with the bias set to 0
    without, with_bias, no_bias = bias_effect(routing)
    changed = without.changed_tokens
    n, e, k = len(routing.token_rows), routing.num_experts, routing.k
    notice(bias_notice(changed, with_bias, no_bias, judge_length=True))
    fair = n * k / e
    load = pd.concat(
        [
            pd.DataFrame(
                {"routing": "with the bias (the model)", "expert": range(e), "count": with_bias.counts}
            ),
            pd.DataFrame({"routing": "without the bias", "expert": range(e), "count": no_bias.counts}),
        ],
        ignore_index=True,
    ).assign(fair=fair)
    chart, metrics = beside()
    with chart:
        exports.show_chart(
            choice_load_chart(
                load,
                title=f"Load with and without the bias, MoE layer {layer}",
                height=presentation.height("learn_bias"),
            ),
            "learn_bias",
        )
    metrics.metric("Tokens that change experts", f"{changed} of {n}", width="content")
    metrics.metric("Load entropy, with the bias", f"{with_bias.load_entropy:.3f}", width="content")
    metrics.metric("Load entropy, without", f"{no_bias.load_entropy:.3f}", width="content")
    spread = bias_stats(routing.bias)
    lesson_ui.details(
        f"{lesson_ui.BIASED}: sigmoid scores; the experts are chosen on score + b_e (b learned in "
        "training: raised for underused experts, lowered for overused ones), the weights use the score "
        f"alone; at this layer std(b) = {spread.std:.3f}, largest |b| = {spread.max_abs:.3f}. "
        f"Without the bias: the same router (best {routing.topk_group} of {routing.n_group} groups, then "
        f"top-{k}) on the scores alone."
    )


# ---- 7 -------------------------------------------------------------------------------------------------
def shared_step() -> None:
    control = lesson_ui.step_heading("7 · Shared experts")
    trace = trace_of(lesson_ui.BIASED)
    site, layer = pick_layer(trace, "learn_shared_layer", control)
    routing = trace.layer(layer, site)
    shares = expert_token_share(routing)
    model = caches.get_model(lesson_ui.BIASED).model
    params = expert_parameters(model, layer)
    k, e, s = routing.k, routing.num_experts, routing.shared_experts
    fraction = shared_fraction(params, k, e)
    notice(shared_notice(shares, fraction))
    chart, metrics = beside()
    with chart:
        exports.show_chart(
            shared_experts_chart(
                shares,
                k=k,
                title=f"Share of the tokens each expert processes, layer {layer}",
                height=presentation.height("learn_shared"),
            ),
            "learn_shared",
        )
    metrics.metric(
        "Shared experts", s, help="Experts every token runs through, besides the routed ones", width="content"
    )
    metrics.metric("Routed experts per token", f"{k} of {e}", width="content")
    metrics.metric(
        "Shared share of weights",
        f"{fraction:.0%}",
        help="The shared expert's share of the expert weights a token runs through, shared / (shared + "
        f"routed · k/E): {params['shared']:,} shared and {params['routed']:,} routed parameters here",
        width="content",
    )
    lesson_ui.details(
        f"{lesson_ui.BIASED}: each MoE layer has {s} shared expert and {e} routed ones. The shared "
        "expert learns what every token needs, so the routed experts are free to specialise (DeepSeekMoE)."
    )


# ---- 8 -------------------------------------------------------------------------------------------------
def finetune_step() -> None:
    st.subheader("8 · What fine-tuning does to routing")
    shipped = finetune_lesson.read_shipped()
    if shipped is None:
        st.info(
            f"The shipped fine-tuning run (sample_models/{finetune_lesson.FOLDER}) is missing: "
            f"`{finetune_lesson.RECIPE}` writes it.",
            icon=":material/folder_off:",
        )
        return
    rows = finetune_lesson.summary(shipped)
    notice(finetune_lesson.notice(rows, shipped) + finetune_lesson.frozen_layer_note(shipped))
    colours = mode_colours(shipped.labels)
    projector = presentation.projector()  # a 720-pixel screen: the table below is the colour key
    if not projector:
        st.markdown(finetune_lesson.colour_key(colours), unsafe_allow_html=True)  # one key for four panels
    curves = finetune_lesson.chart_frame(shipped)
    for area, metric in zip(st.columns(len(LESSON_METRICS), gap="small"), LESSON_METRICS, strict=True):
        with area:
            exports.show_chart(
                finetune_lesson_chart(
                    curves,
                    metric,
                    runs=shipped.labels,
                    height=presentation.height("learn_finetune"),
                    reference=1 / shipped.experts if metric == "max_share" else None,
                ),
                f"learn_finetune_{metric}",
            )
    explanation = finetune_lesson.explanation(shipped)
    # on a projector the explanation goes behind "Details"
    table, text = (st.container(), None) if projector else st.columns([3, 2], gap="medium")
    shown = finetune_lesson.table(rows)
    table.dataframe(
        shown.style.map(lambda mode: f"color: {colours[mode]}; font-weight: 600", subset=["mode"]),
        hide_index=True,
        key="learn_finetune_table",
    )
    if text is not None:
        text.markdown(explanation)
    config = shipped.meta["config"]
    lesson_ui.details(
        (explanation + "\n\n" if projector else "")
        + f"{config['start']} fine-tuned on {shipped.domain}'s held-out text (new to it) for {shipped.steps} "
        f"steps of {config['batch']} × {config['seq']} tokens, lr {config['lr']:g}, seed "
        f"{shipped.meta['seed']}, in each mode; evaluated after every step on held-out windows of the new "
        "and the old domains. "
        "Adapted: the new-domain loss fell by at least "
        f"{shipped.meta['thresholds']['adapted_drop']:g} nats; forgot: the old domains' rose by more than "
        f"{shipped.meta['thresholds']['forgot_rise']:g}; routing changed: top-k sets that differ from the "
        "base's; most changed layer: on all the new domain's held-out tokens. Recipe: "
        f"`{finetune_lesson.RECIPE}`; the Lab's Fine-tune section runs it live."
    )


# ---- 9 -------------------------------------------------------------------------------------------------
def deployment_step() -> None:
    st.subheader("9 · Where deployment questions come in")
    model = caches.get_model(lesson_ui.BIASED).model
    trace = trace_of(lesson_ui.BIASED)
    first = trace.layers[0]
    params = parameter_summary(model, experts=first.num_experts, top_k=first.k)
    notice(
        f"all {params['experts']} experts of every layer must sit in memory, but a token uses "
        f"{params['top_k']}: {params['total']:,} parameters to hold, {params['active']:,} "
        f"({params['active_fraction']:.0%}) to compute per token. Memory, communication between GPUs and "
        "uneven load follow from that."
    )
    metrics = st.container(horizontal=True, gap="large")
    metrics.metric("Parameters to hold", f"{params['total']:,}", width="content")
    metrics.metric("Active per token", f"{params['active']:,}", width="content")
    metrics.metric("Active fraction", f"{params['active_fraction']:.0%}", width="content")
    bullets, links = presentation.beside([3, 2])  # side by side on a projector
    bullets.markdown(
        "- **Expert parallelism**: experts spread over GPUs; an uneven load makes one GPU the bottleneck.\n"
        "- **Offloading**: experts kept in CPU memory or on disk and fetched when a token needs them.\n"
        "- **Capacity**: a cap on tokens per expert drops the overflow.\n"
        "- **Quantisation**: smaller weights can flip close routing decisions."
    )
    with links:
        lesson_ui.page_link_if_registered(
            "pages/deployment.py", "Deployment what-ifs on a captured text", ":material/dns:"
        )
        lesson_ui.page_link_if_registered(
            "pages/playground.py", "Routing playground: change k, bias, capacity on a text", ":material/tune:"
        )
        lesson_ui.page_link_if_registered("pages/lab.py", "Lab: train a small MoE live", ":material/science:")
    lesson_ui.details(
        f"{lesson_ui.BIASED}; parameters counted on the loaded model (active = total − routed × (1 − k/E))."
    )


# ---- 10 (when the sweep is shipped) --------------------------------------------------------------------
def sweep_step() -> None:
    st.subheader("10 · How many experts?")
    sweep = lesson_ui.experts_sweep()
    notice(sweep_notice(sweep))
    exports.show_chart(experts_sweep_chart(sweep, height=presentation.height("learn_sweep")), "learn_sweep")
    lesson_ui.details(
        "docs/experts-sweep.csv: small MoE models trained on the sample corpus with the same tokens and "
        "matched active parameters; held-out loss on the evaluation slices. At this small scale the curve "
        "shows the trend, not the values a large model would reach."
    )


STEPS = {
    "router": ("1 Router", router_step),
    "top_k": ("2 Top-k", top_k_step),
    "load": ("3 Load", load_step),
    "aux": ("4 Aux loss", aux_loss_step),
    "collapse": ("5 Collapse", collapse_step),
    "bias": ("6 Bias", bias_step),
    "shared": ("7 Shared", shared_step),
    "finetune": ("8 Fine-tuning", finetune_step),
    "deployment": ("9 Deploy", deployment_step),
}
if lesson_ui.experts_sweep() is not None:
    STEPS["sweep"] = ("10 How many?", sweep_step)
READS_TEXT = {"router", "top_k", "load", "aux", "collapse", "bias", "shared"}  # the steps that route a text

lesson_ui.compact_top()
st.title("Learn: how MoE routing works")
share.restore(share.STEP, lesson_ui.STEP_KEY, list(STEPS), "Learn steps")  # a link to a step opens it
step = lesson_ui.step_picker({key: label for key, (label, _) in STEPS.items()})
share.publish(share.STEP, step)
if step in READS_TEXT:
    TEXT = lesson_ui.lesson_text(st.sidebar)
    if TEXT is None:
        lesson_ui.empty_text_message()
        st.stop()
    lesson_ui.forget_choices_on_new_text(TEXT, [f"learn_{name}_layer" for name in READS_TEXT])
STEPS[step][1]()
share.reproduce(lambda: share.learn_code(step), f"step {STEPS[step][0]}")
