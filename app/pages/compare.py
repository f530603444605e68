"""Compare: two models or checkpoints on the same text, side by side and as differences."""

import streamlit as st
from components import access, caches, expert_axis, exports, load_options, page_input, pickers, prompt, share

from moeviz import snippets
from moeviz.analysis import (
    expert_balance_frame,
    expert_drift_frame,
    lineage,
    match_tokens,
    routing_agreement_frame,
)
from moeviz.charts import agreement_chart
from moeviz.charts.compare import side_by_side_load_heatmap

st.title("Compare")
source = pickers.model_picker()
choices = list(dict.fromkeys([source, *access.sample_sources()]))
defaults = {"compare_a": source, "compare_b": "sample:mixtral-unbalanced"}
for key, default in defaults.items():
    if st.session_state.get(key) not in choices:
        st.session_state[key] = default if default in choices else choices[-1]
left, right = st.columns(2)
source_a = left.selectbox("Model A", choices, key="compare_a")
source_b = right.selectbox(
    "Model B (the reference)", choices, key="compare_b", help="e.g. the final checkpoint"
)
st.caption("Checkpoints of a series (mixtral-healthy-series/step-…) compare training stages of one model.")


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
