"""Compare: two models or checkpoints on the same text, side by side and as differences; when one is the
other's fine-tune (a LoRA adapter over the same base, or a later model of one training lineage), what the
fine-tune did (`moeviz.analysis.finetune_diff`), per domain on the evaluation corpus on request."""

import dataclasses

import streamlit as st
from components import access, caches, expert_axis, exports, load_options, page_input, pickers, prompt, share
from components.counterfactual import cost_line, forward_timing

import moeviz
from moeviz import snippets
from moeviz.analysis import (
    expert_balance_frame,
    expert_drift_frame,
    lineage,
    match_tokens,
    routing_agreement_frame,
)
from moeviz.analysis.finetune_diff import FinetuneDiff, RouterWeight, finetune_diff, router_weights
from moeviz.charts import agreement_chart
from moeviz.charts.compare import side_by_side_load_heatmap
from moeviz.charts.engines import layer_mismatch_chart
from moeviz.charts.finetune import (
    balance_change_chart,
    domain_took_chart,
    load_shift_band_chart,
    router_delta_chart,
    specialisation_change_heatmap,
)
from moeviz.interventions.cost import capture_cost
from moeviz.samples import DOMAINS, eval_batch

CORPUS_RUNS = "finetune_corpus_runs"  # session: the (base key, tuned key) pairs run on the evaluation corpus


def base_of(key: str) -> str | None:
    """The model key of the base under a key's adapter (its other load options kept); None without one."""
    source, options = load_options.split_key(key)
    return dataclasses.replace(options, adapter="").key(source) if options.adapter else None


st.title("Compare")
source = pickers.model_picker()
base_choice = base_of(source)
choices = list(dict.fromkeys([source, *([base_choice] if base_choice else []), *access.sample_sources()]))
defaults = {"compare_a": source, "compare_b": base_choice or "sample:mixtral-unbalanced"}
for key, default in defaults.items():
    if st.session_state.get(key) not in choices:
        st.session_state[key] = default if default in choices else choices[-1]
left, right = st.columns(2)
source_a = left.selectbox("Model A", choices, key="compare_a")
source_b = right.selectbox(
    "Model B (the reference)", choices, key="compare_b", help="e.g. the final checkpoint"
)
st.caption(
    "Checkpoints of a series (mixtral-healthy-series/step-…) compare training stages of one model; with an "
    "adapter folder (sidebar, Advanced) the model and its base are both offered: base vs fine-tune."
)


@st.cache_data(show_spinner=False, max_entries=64)
def lineage_of(key_a: str, key_b: str) -> tuple[bool, str] | None:
    """(related, reason) of two model keys from their weights (`moeviz.analysis.lineage`); None when the
    weights cannot be read (then nothing is claimed)."""
    try:
        a, b = (access.check_source(load_options.source_of(key)) for key in (key_a, key_b))
        result = lineage(a, b)
    except Exception:  # e.g. no safetensors weights: the check is skipped, not the page
        return None
    return (result.related, result.reason) if result.checked else None


LINEAGE = lineage_of(source_a, source_b)
UNRELATED = LINEAGE is not None and not LINEAGE[0]
if UNRELATED:
    st.warning(
        f"**A and B are not one training run** ({LINEAGE[1]}). Expert ids of models trained "
        "separately do not correspond: expert 3 of A has nothing to do with expert 3 of B, so the routing "
        "agreement, top-1 agreement and load shift below (all by expert id) do not measure anything. What "
        "still means something: each model's own load balance (the two heatmaps, read separately).",
        icon=":material/warning:",
    )
page_input.runs_the_model("Compare")  # a routing file chosen elsewhere: said, not used
text = prompt.prompt_form()
trace_a = caches.load_or_stop(source_a, text)
trace_b = caches.load_or_stop(source_b, text)
share.reproduce(lambda: snippets.compare_view(*map(load_options.source_of, (source_a, source_b)), text))

load_a, load_b = expert_balance_frame(trace_a), expert_balance_frame(trace_b)
# the axis of the model with more experts (A's when they have as many)
axis = expert_axis.expert_axis(load_b if load_b["expert"].max() > load_a["expert"].max() else load_a)
# side by side; at scale one above the other (an overview + detail each needs the whole width)
places = (st.container(), st.container()) if axis.at_scale else st.columns(2)
for place, key, load, name in zip(
    places, ("load_a", "load_b"), (load_a, load_b), (f"A: {source_a}", f"B: {source_b}"), strict=True
):
    with place:
        if axis.at_scale:
            expert_axis.show_layer_expert_heatmap(load, "utilisation", axis.fitting(load), key, title=name)
        else:  # half a column each: the legend under the cells, where it fits
            exports.show_chart(side_by_side_load_heatmap(load, title=name), key)
st.caption("Utilisation c_e / (kT/E) per layer and expert in each model (white = fair share).")

try:
    match_tokens(trace_a, trace_b)
except ValueError:
    st.warning(
        "The two models split this text into different tokens (different tokenizers or vocabularies), so "
        "their routing cannot be compared token by token: only the side-by-side load above is meaningful."
    )
    st.stop()

try:
    agreement = routing_agreement_frame(trace_a, trace_b)
    drift = expert_drift_frame(trace_a, trace_b)
except ValueError as exc:  # no common MoE layer, or different expert counts
    st.warning(
        f"The two models' routers cannot be aligned layer by layer ({exc}): only the load is compared."
    )
    st.stop()

st.subheader("Differences")
if UNRELATED:
    st.caption("By expert id across two unrelated models: see the warning above; not a measure of agreement.")
exports.show_chart(agreement_chart(agreement), "agreement")
st.caption(
    "Per layer, over the same tokens: top-k overlap (saturation) = mean_t |Sᵃ_t ∩ Sᵇ_t| / |Sᵇ_t|; "
    "same top-1 = share of tokens whose top-1 expert agrees; Jaccard = mean_t |Sᵃ ∩ Sᵇ| / |Sᵃ ∪ Sᵇ|. "
    "1 = identical routing; for checkpoints, saturation near 1 means the router had already settled."
)
exports.table_downloads(agreement, "agreement")

expert_axis.show_layer_expert_heatmap(
    drift, "load_change", axis.fitting(drift), "load_shift", "Load shift A → B"
)
st.caption(
    "Load change c_e(B) − c_e(A) in tokens; hover for retained = |Tᵃ_e ∩ Tᵇ_e| / |Tᵃ_e| (of A's tokens, "
    "the share B still sends to e) and drift = 1 − Jaccard of the two token sets. Expert ids only mean the "
    "same thing across checkpoints of one run, not across models trained separately."
)
exports.table_downloads(drift, "load_shift")


# ---- what the fine-tune did -------------------------------------------------------------------------------
def finetune_pair(key_a: str, key_b: str) -> tuple[str, str, str] | None:
    """(base key, fine-tune key, why) when one side is the other's fine-tune: the same source and options
    with an adapter on one side only, or (a lineage check said related) A as the base, B the later model."""
    if key_a == key_b:
        return None
    if base_of(key_a) == key_b:
        return key_b, key_a, "A is B with a LoRA adapter merged"
    if base_of(key_b) == key_a:
        return key_a, key_b, "B is A with a LoRA adapter merged"
    if LINEAGE is not None and LINEAGE[0]:
        return key_a, key_b, "A and B are one training lineage: A is read as the base, B as the fine-tune"
    return None


@st.cache_resource(show_spinner=False, max_entries=8)
def router_weights_of(key: str) -> dict[tuple[str, int], RouterWeight]:
    """Each MoE layer's router weight of the model of `key` (`router_weights`), read once per model key."""
    return router_weights(caches.get_model(key))


@st.cache_resource(show_spinner="Diffing the fine-tune against its base…", max_entries=8)
def finetune_of(
    base_key: str, tuned_key: str, text: str, _base: moeviz.Trace, _tuned: moeviz.Trace
) -> FinetuneDiff:
    """`finetune_diff` of the two captures of `text` (`_base`, `_tuned`: not hashed), with both routers'
    weights; shared read-only by every session (per base, fine-tune and text)."""
    return finetune_diff(
        _base, _tuned, base_weights=router_weights_of(base_key), tuned_weights=router_weights_of(tuned_key)
    )


@st.cache_data(show_spinner=False, max_entries=8)
def corpus_domains(key: str) -> tuple[list[str], list[int]]:
    """The evaluation corpus of the model of `key` (`eval_batch`): the domain of each sequence, and the
    tokens of each domain's capture (one forward per domain, as `caches.corpus_trace` runs it)."""
    batch = eval_batch(caches.get_model(key))
    tokens = [
        sum(len(ids) for ids, d in zip(batch.token_ids, batch.domains, strict=True) if d == domain)
        for domain in DOMAINS
    ]
    return batch.domains, [n for n in tokens if n]


@st.cache_resource(show_spinner="Diffing the fine-tune per domain…", max_entries=4)
def finetune_corpus_of(
    base_key: str, tuned_key: str, _base: moeviz.Trace, _tuned: moeviz.Trace, _domains: tuple[str, ...]
) -> FinetuneDiff:
    """`finetune_diff` of the two evaluation-corpus captures, each sequence labelled by its domain."""
    return finetune_diff(
        _base,
        _tuned,
        base_weights=router_weights_of(base_key),
        tuned_weights=router_weights_of(tuned_key),
        seq_domains=list(_domains),
    )


PAIR = finetune_pair(source_a, source_b)
if PAIR is not None:
    base_key, tuned_key, why = PAIR
    base_trace, tuned_trace = (trace_a, trace_b) if base_key == source_a else (trace_b, trace_a)
    st.subheader("What the fine-tune did")
    st.caption(f"Base: {base_key}. Fine-tune: {tuned_key} ({why}). On the same tokens of the prompt.")
    diff = finetune_of(base_key, tuned_key, text, base_trace, tuned_trace)
    moved = diff.moved_experts()
    delta = diff.router_delta
    metrics = st.container(horizontal=True, gap="large")
    metrics.metric(
        "Router mismatch",
        f"{diff.routing.router_mismatch:.2%}",
        help="Share of (token, layer) pairs whose top-k expert sets differ (`engine_diff`)",
        width="content",
    )
    metrics.metric(
        "Experts whose load moved",
        f"{len(moved):,} of {len(diff.load_shift):,}",
        help=f"(layer, expert) pairs whose {diff.level:.0%} paired bootstrap band of the load shift "
        "excludes 0",
        width="content",
    )
    metrics.metric(
        "Balance verdict",
        f"{diff.verdict_base} → {diff.verdict_tuned}",
        "worse" if diff.degraded else "not worse",
        delta_color="inverse" if diff.degraded else "off",
        delta_arrow="off",
        width="content",
        help="The collapse verdict of the base and of the fine-tune (the worst layer's)",
    )
    if delta is not None and len(delta):
        metrics.metric(
            "Largest router delta",
            f"{delta['relative'].max():.3g}",
            f"rank ≤ {delta['rank'].max()}",
            delta_color="off",
            delta_arrow="off",
            width="content",
            help="max over layers of ‖W_tuned − W_base‖_F / ‖W_base‖_F of the router weight, and the largest "
            "rank of the change (a LoRA of rank r changes a router by rank ≤ r)",
        )
    exports.show_chart(layer_mismatch_chart(diff.routing.layers), "finetune_mismatch")
    st.caption(
        "Per layer, over the same tokens: router mismatch = share of tokens whose top-k sets differ; top-1 "
        "mismatch; 1 − mean Jaccard of the sets; the routers' total-variation distance."
    )
    exports.show_chart(load_shift_band_chart(diff.load_shift, level=diff.level), "finetune_shift")
    st.caption(
        "Load shift = f_tuned − f_base of an expert's share of the layer's k·T slots, with its "
        f"{diff.level:.0%} paired bootstrap band ({diff.draws:,} resamples of the tokens, the same tokens "
        "for both sides); red = the band excludes 0 (the expert moved). The 20 largest, moved first."
    )
    st.dataframe(moved, hide_index=True, key="finetune_moved")
    exports.table_downloads(diff.load_shift, "finetune_load_shift")
    exports.show_chart(balance_change_chart(diff.balance), "finetune_balance")
    st.dataframe(diff.balance, hide_index=True, key="finetune_balance_table")
    if delta is not None and len(delta):
        exports.show_chart(router_delta_chart(delta), "finetune_delta")
        st.caption(
            "ΔW = W_tuned − W_base of each router's [E, H] weight: bar = ‖ΔW‖_F / ‖W_base‖_F, label = its "
            "rank (singular values above the weights' own rounding, max(E, H)·eps·σ_max(W_base))."
        )
        st.dataframe(delta, hide_index=True, key="finetune_delta_table")
    else:
        st.caption("No router weights to compare (the routers hold no [E, H] matrix).")

    st.markdown("**Per domain: which experts took each domain** (the evaluation corpus)")
    base_model = caches.get_model(base_key)
    ran = (base_key, tuned_key) in st.session_state.get(CORPUS_RUNS, set())
    if base_model.tokenizer is None:
        st.caption("The evaluation corpus needs a model with a tokenizer: no change per domain here.")
    elif not ran:
        domains, forward_tokens = corpus_domains(base_key)
        first = base_trace.tokens.loc[base_trace.tokens["seq"] == 0, "token_id"].tolist()
        timing = forward_timing(base_key, base_model, first)
        cost = capture_cost(timing, [*forward_tokens, *forward_tokens])  # the base and the fine-tune
        st.caption(
            f"Runs both models on the evaluation corpus ({len(domains)} windows of {len(set(domains))} "
            "domains), then per (layer, domain, expert) the expert's share of the domain's slots before and "
            "after, with a paired bootstrap band over the domain's tokens. " + cost_line(cost, timing)
        )
        if st.button("Run both on the evaluation corpus", key="finetune_corpus"):
            st.session_state.setdefault(CORPUS_RUNS, set()).add((base_key, tuned_key))
            ran = True
    if ran:
        domains, _ = corpus_domains(base_key)
        base_corpus, tuned_corpus = caches.corpus_trace(base_key), caches.corpus_trace(tuned_key)
        by_domain = finetune_corpus_of(base_key, tuned_key, base_corpus, tuned_corpus, tuple(domains))
        took = by_domain.took_domains()
        st.caption(
            f"{len(took):,} (layer, domain, expert) rows where the expert took the domain: its share of the "
            f"domain's slots rose and the {by_domain.level:.0%} paired bootstrap band over the domain's "
            "tokens excludes 0."
        )
        exports.show_chart(specialisation_change_heatmap(by_domain.specialisation), "finetune_specialisation")
        st.caption(
            "Specialisation of a domain D = max_e DS(e, D), DS(e, D) = share of D's tokens whose expert set "
            "includes e (OLMoE's domain specialisation); cell = after − before, number = experts that took D."
        )
        st.dataframe(by_domain.specialisation, hide_index=True, key="finetune_specialisation_table")
        exports.show_chart(domain_took_chart(by_domain.domain_shift, level=by_domain.level), "finetune_took")
        st.dataframe(took, hide_index=True, key="finetune_took_table")
        exports.table_downloads(by_domain.domain_shift, "finetune_domain_shift")
    share.reproduce(
        lambda: snippets.finetune_view(
            share.snippet_input(base_key, text=text), share.snippet_input(tuned_key, text=text), domains=ran
        ),
        "this section",
    )
