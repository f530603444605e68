"""Load and collapse: how evenly each layer spreads tokens over its experts, and the verdicts."""

import state
import streamlit as st

from moeviz.analysis import (
    CollapseThresholds,
    balance_frame,
    collapse_frame,
    collapse_report,
    expert_balance_frame,
)
from moeviz.charts import balance_chart, dead_hot_experts, load_heatmap

INDICATORS = {
    "load_entropy": "H(f) / log E, f_e = slot share of expert e: 1 = even, 0 = one expert takes all.",
    "effective_experts": "exp(H(f)): how many equally loaded experts give the same entropy (E when even).",
    "max_share": "max_e f_e: the busiest expert's share of all slots; 1/E when even.",
    "max_vio": "max_e c_e / (kT/E) − 1: how far the busiest expert exceeds its fair share (0 when even).",
    "cv": "Coefficient of variation of the counts, std(c) / mean(c) (0 when even).",
    "gini": "Gini coefficient of the counts: 0 = even, → 1 = all on one expert.",
    "jain": "Jain's fairness (Σc)² / (E Σc²): 1 = even, 1/E = all on one expert.",
    "dead_fraction": "Share of experts that received no token (0 when every expert is used).",
}

st.title("Load and collapse")
source = state.model_picker()
trace = state.prompt_or_corpus_trace(source)
st.caption(f"{trace.model.architecture} · {len(trace.tokens)} tokens · {len(trace.layer_keys)} MoE layers")

experts = expert_balance_frame(trace)
state.show_chart(load_heatmap(experts), "load_heatmap")
st.caption(
    "Utilisation u_e = c_e / (kT/E): tokens an expert received over its fair share (k slots × T tokens "
    "spread over E experts). White = exactly fair, red = overloaded, blue = underused; log₂ scale, "
    "so ½× and 2× look equally strong."
)
state.table_downloads(experts, "expert_load")

st.subheader("Balance per layer")
balance = balance_frame(trace)
metric = st.selectbox("Indicator", list(INDICATORS), key="balance_metric")
state.show_chart(balance_chart(balance, metric), "balance")
st.caption(f"{INDICATORS[metric]} Dashed red tick = the value under perfectly uniform load.")
with st.expander("All indicators, explained"):
    for name, explanation in INDICATORS.items():
        st.markdown(f"- **{name}** — {explanation}")
st.dataframe(balance, hide_index=True)
state.table_downloads(balance, "balance")

st.subheader("Collapse verdicts")
thresholds = CollapseThresholds()
report = collapse_report(trace, thresholds)
verdicts = collapse_frame(report)
st.markdown(f"Model verdict: **{report.verdict.name.lower()}** (the worst layer's).")
st.caption(
    f"A layer is *collapsed* when one expert takes over {thresholds.collapsed_max_share:.0%} of slots, "
    f"over {thresholds.collapsed_dead_fraction:.0%} of experts are dead or load entropy is below "
    f"{thresholds.collapsed_load_entropy}; *warning* at {thresholds.warning_share_factor}× the fair share, "
    f"{thresholds.warning_dead_fraction:.0%} dead or entropy below {thresholds.warning_load_entropy}. "
    f"Load is judged only with ≥ {thresholds.min_slots_per_expert:g} slots per expert."
)
st.dataframe(verdicts, hide_index=True)
state.table_downloads(verdicts, "collapse_verdicts")

st.subheader("Dead and hot experts")
flagged = dead_hot_experts(experts, hot_factor=thresholds.warning_share_factor)
st.caption(
    f"Dead = received no token; hot = utilisation above {thresholds.warning_share_factor}× its fair share."
)
if flagged.empty:
    st.success("No dead or hot expert.")
else:
    st.dataframe(flagged, hide_index=True)
state.table_downloads(flagged, "dead_hot_experts")
