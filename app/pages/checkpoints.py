"""Checkpoints: how routing settles over training — saturation, balance, drift and specialisation."""

import streamlit as st
from components import exports, share
from components.checkpoint_store import (
    WINDOW_TOKENS,
    WINDOWS,
    run_timeline,
    series_breaks,
    series_picker,
    timeline_table,
)

from moeviz import snippets
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
series, base = series_picker()  # base: the base model of a series of adapters, else None
# the controls first, then the (slow, once per server) tracing with its progress, then the charts
left, right = st.columns(2)
kind = left.radio("Saturation agreement", ["topk", "top1"], horizontal=True, key="saturation_kind")
indicator = right.selectbox("Balance indicator", list(TIMELINE_INDICATORS), key="timeline_indicator")
breaks = series_breaks(series, base)  # weights only: milliseconds, before any tracing
timeline = run_timeline(series, base)
over = f" · adapters over {base} (the base alone is {timeline.checkpoints[0]})" if base else ""
st.caption(
    f"{timeline.model} · {len(timeline.checkpoints)} checkpoints ({timeline.checkpoints[0]} … "
    f"{timeline.checkpoints[-1]}) · final = {timeline.checkpoints[-1]}{over}"
)
saturation, drift = timeline.saturation, timeline.drift
if breaks:  # expert ids do not correspond across a break: no agreement is drawn across it
    pairs = "; ".join(f"**{a} → {b}**: {reason}" for a, b, reason in breaks)
    since = breaks[-1][1]
    st.warning(
        f"Not one training run: {pairs}. Expert ids of models trained separately do not correspond "
        f"(expert 3 of one has nothing to do with expert 3 of the other), so saturation (agreement with the "
        f"final checkpoint) is drawn only from {since} on and drift is left out at "
        f"{', '.join(b for _, b, _ in breaks)}. Balance and specialisation are per checkpoint and still hold."
    )
    kept = timeline.checkpoints[timeline.checkpoints.index(since) :]
    saturation = saturation[saturation["checkpoint"].isin(kept)]
    drift = drift[~drift["checkpoint"].isin([b for _, b, _ in breaks])]

st.subheader("Router saturation")
exports.show_chart(saturation_timeline_chart(saturation, kind), "saturation_timeline")
st.caption(
    "Share of each token's experts that the final checkpoint also chooses (top-1: same first expert): "
    "how early a layer's routing is already the routing it ends with."
)

st.subheader("Balance")
exports.show_chart(
    balance_timeline_chart(timeline.collapse, indicator, timeline.crossings), "balance_timeline"
)
st.caption(
    f"{TIMELINE_INDICATORS[indicator].capitalize()} per layer and checkpoint; dashed lines are the "
    "warning (orange) and collapsed (red) thresholds of the collapse verdict."
)
if indicator == "z_loss" and not (timeline.crossings["indicator"] == "z_loss").any():
    st.caption(
        "No z-loss threshold: these routers score each expert on its own (sigmoid), with no softmax "
        "partition function, and are not trained with a z-loss; its value is shown for reference only."
    )

st.subheader("Expert drift")
if len(drift):
    exports.show_chart(drift_timeline_chart(drift), "drift_timeline")
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
share.reproduce(lambda: snippets.checkpoints_view(series, WINDOWS, WINDOW_TOKENS, kind, indicator, base=base))
