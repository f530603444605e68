"""Checkpoints: how routing settles over training — saturation, balance, drift and specialisation."""

import os
import tempfile
from pathlib import Path

import state
import streamlit as st

import moeviz
from moeviz.charts.checkpoints import (
    TIMELINE_INDICATORS,
    balance_timeline_chart,
    drift_timeline_chart,
    saturation_timeline_chart,
    specialisation_timeline_chart,
)
from moeviz.models.loading import sample_models_dir
from moeviz.samples import write_eval_prefix
from moeviz.store import TraceSettings, trace_corpus
from moeviz.store.checkpoints import CheckpointTimeline, checkpoint_timeline, resolve_series

WINDOWS, WINDOW_TOKENS = 2, 256  # the fixed token set per domain: small, so a series runs in seconds
SETTINGS = TraceSettings(batch_size=WINDOWS, chunk_tokens=WINDOW_TOKENS)


def sample_series() -> list[str]:
    """Sample checkpoint series: the folders of the samples named `<series>/step-*`."""
    names = {name.split("/")[0] for name in moeviz.list_samples() if "/" in name}
    return [str(sample_models_dir() / name) for name in sorted(names)]


@st.cache_resource(show_spinner=False, max_entries=4)
def series_store(series: str) -> str:
    """A store folder kept for the server's life, one per series; its checkpoints are traced on demand."""
    return tempfile.mkdtemp(prefix="moeviz-app-timeline-")


@st.cache_resource(show_spinner=False, max_entries=4)
def small_corpus(series: str, first_folder: str) -> str:
    """The first WINDOWS × WINDOW_TOKENS tokens of each evaluation slice (the series' tokenizer), as a
    corpus folder: every checkpoint is traced on exactly these tokens."""
    folder = Path(tempfile.mkdtemp(prefix="moeviz-app-corpus-"))
    return str(write_eval_prefix(moeviz.load_model(first_folder), folder, WINDOWS * WINDOW_TOKENS))


@st.cache_resource(show_spinner=False, max_entries=64)
def traced_checkpoint(series: str, label: str, folder: str, index: int) -> str:
    """Trace one checkpoint of `series` into its store (once per server process; resumable)."""
    name, checkpoints = resolve_series(series)
    trace_corpus(
        moeviz.load_model(folder),
        small_corpus(series, str(checkpoints[0][1])),
        series_store(series),
        model=name,
        checkpoint=label,
        checkpoint_index=index,
        settings=SETTINGS,
        resume=True,
        progress=False,
    )
    return label


@st.cache_data(show_spinner=False, max_entries=8)
def timeline_of(series: str) -> CheckpointTimeline:
    """The timeline of a fully traced series (call after `traced_checkpoint` for every checkpoint)."""
    name, _ = resolve_series(series)
    return checkpoint_timeline(series_store(series), model=name)


def run_timeline(series: str) -> CheckpointTimeline:
    """Trace every checkpoint (progress bar per checkpoint), then compute the timeline; errors stop."""
    with state.stop_on_error():
        _, checkpoints = resolve_series(series)
        bar = st.progress(0.0, text="Tracing the checkpoints…")
        for i, (label, folder) in enumerate(checkpoints):
            bar.progress(
                i / len(checkpoints), text=f"Tracing checkpoint {label} ({i + 1}/{len(checkpoints)})…"
            )
            traced_checkpoint(series, label, str(folder), i)
        bar.progress(1.0, text="Comparing the checkpoints…")
        timeline = timeline_of(series)
        bar.empty()
        return timeline


st.title("Checkpoints")
st.markdown(
    f"Every checkpoint of a training run routes the same {WINDOWS} × {WINDOW_TOKENS} tokens of each "
    "evaluation domain; the lines show how each MoE layer's routing settles."
)
choices = sample_series()
with st.sidebar:
    options = [*choices, state.LOCAL_FOLDER]
    choice = st.selectbox(
        "Checkpoint series", options, key="series_choice", format_func=lambda p: Path(p).name
    )
    series = choice
    if choice == state.LOCAL_FOLDER:
        series = st.text_input(
            "Series folder",
            key="series_folder",
            help="A folder of checkpoint folders (each with config.json).",
        )
with state.stop_on_error():
    series = series if series in choices else state.check_source(series or "")  # samples: always allowed
if not os.path.isdir(series):
    st.error(f"{series} is not a folder")
    st.stop()

timeline = run_timeline(series)
st.caption(
    f"{timeline.model} · {len(timeline.checkpoints)} checkpoints ({timeline.checkpoints[0]} … "
    f"{timeline.checkpoints[-1]}) · final = {timeline.checkpoints[-1]}"
)

st.subheader("Router saturation")
kind = st.radio("Agreement", ["topk", "top1"], horizontal=True, key="saturation_kind")
state.show_chart(saturation_timeline_chart(timeline.saturation, kind), "saturation_timeline")
st.caption(
    "Share of each token's experts that the final checkpoint also chooses (top-1: same first expert): "
    "how early a layer's routing is already the routing it ends with."
)

st.subheader("Balance")
indicator = st.selectbox("Indicator", list(TIMELINE_INDICATORS), key="timeline_indicator")
state.show_chart(balance_timeline_chart(timeline.collapse, indicator, timeline.crossings), "balance_timeline")
st.caption(
    f"{TIMELINE_INDICATORS[indicator].capitalize()} per layer and checkpoint; dashed lines are the "
    "warning (orange) and collapsed (red) thresholds of the collapse verdict."
)

st.subheader("Expert drift")
if len(timeline.drift):
    state.show_chart(drift_timeline_chart(timeline.drift), "drift_timeline")
    st.caption(
        "How much each expert's set of tokens changed since the previous checkpoint (mean over experts): "
        "0 = same tokens, 1 = entirely different ones."
    )

st.subheader("Domain specialisation")
state.show_chart(specialisation_timeline_chart(timeline.specialisation), "specialisation_timeline")
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
state.table_downloads(timeline.crossings, "threshold_crossings")

st.subheader("Downloads")
frame = (
    timeline.collapse.merge(
        timeline.saturation.drop(columns="tokens"), on=["checkpoint", "order", "site", "layer"], how="left"
    )
    .sort_values(["order", "site", "layer"])
    .reset_index(drop=True)
)
st.caption("Per checkpoint × layer: balance, verdict and saturation (drift and specialisation separately).")
state.table_downloads(frame, "checkpoint_timeline")
state.table_downloads(timeline.drift, "expert_drift")
state.table_downloads(timeline.specialisation, "domain_specialisation_timeline")
