"""Checkpoints: how routing settles over training — saturation, balance, drift and specialisation."""

import streamlit as st
from components import exports
from components.checkpoint_store import WINDOW_TOKENS, WINDOWS, run_timeline, series_picker, timeline_table

from moeviz.charts.checkpoints import (
    TIMELINE_INDICATORS,
    balance_timeline_chart,
    drift_timeline_chart,
    saturation_timeline_chart,
    specialisation_timeline_chart,
)

st.title("Checkpoints")
st.markdown(
    f"Every checkpoint of a training run routes the same {WINDOWS} × {WINDOW_TOKENS} tokens of each "
    "evaluation domain; the lines show how each MoE layer's routing settles."
)
series = series_picker()
timeline = run_timeline(series)
st.caption(
    f"{timeline.model} · {len(timeline.checkpoints)} checkpoints ({timeline.checkpoints[0]} … "
    f"{timeline.checkpoints[-1]}) · final = {timeline.checkpoints[-1]}"
)

st.subheader("Router saturation")
kind = st.radio("Agreement", ["topk", "top1"], horizontal=True, key="saturation_kind")
exports.show_chart(saturation_timeline_chart(timeline.saturation, kind), "saturation_timeline")
st.caption(
    "Share of each token's experts that the final checkpoint also chooses (top-1: same first expert): "
    "how early a layer's routing is already the routing it ends with."
)

st.subheader("Balance")
indicator = st.selectbox("Indicator", list(TIMELINE_INDICATORS), key="timeline_indicator")
exports.show_chart(
    balance_timeline_chart(timeline.collapse, indicator, timeline.crossings), "balance_timeline"
)
st.caption(
    f"{TIMELINE_INDICATORS[indicator].capitalize()} per layer and checkpoint; dashed lines are the "
    "warning (orange) and collapsed (red) thresholds of the collapse verdict."
)

st.subheader("Expert drift")
if len(timeline.drift):
    exports.show_chart(drift_timeline_chart(timeline.drift), "drift_timeline")
    st.caption(
        "How much each expert's set of tokens changed since the previous checkpoint (mean over experts): "
        "0 = same tokens, 1 = entirely different ones."
    )

st.subheader("Domain specialisation")
exports.show_chart(specialisation_timeline_chart(timeline.specialisation), "specialisation_timeline")
st.caption(
    "For each domain, how much more often its favourite expert is chosen than chance (lift = DS / (k/E); "
    "1 = no preference)."
)

st.subheader("First checkpoint past a threshold")
crossed = timeline.crossings[timeline.crossings["first_checkpoint"].notna()]
if crossed.empty:
    st.success("No indicator crossed a warning or collapse threshold at any checkpoint.")
else:
    st.dataframe(crossed, hide_index=True)
with st.expander("All thresholds, crossed or not"):
    st.dataframe(timeline.crossings, hide_index=True)
exports.table_downloads(timeline.crossings, "threshold_crossings")

st.subheader("Downloads")
frame = timeline_table(timeline)
st.caption("Per checkpoint × layer: balance, verdict and saturation (drift and specialisation separately).")
exports.table_downloads(frame, "checkpoint_timeline")
exports.table_downloads(timeline.drift, "expert_drift")
exports.table_downloads(timeline.specialisation, "domain_specialisation_timeline")
