"""The Checkpoints page's store: every checkpoint of a series traced on the same small token set, once per
server process, and the timeline computed from it. A series of fine-tuning adapters is traced over the base
model picked beside it (`base`: a model source; None for full checkpoints)."""

from __future__ import annotations

import itertools
import tempfile
from pathlib import Path

import pandas as pd
import streamlit as st

import moeviz
from components import access
from components.errors import stop_on_error
from moeviz.analysis import lineage
from moeviz.models.loading import sample_models_dir
from moeviz.samples import write_eval_prefix
from moeviz.store import TraceSettings, write_corpus
from moeviz.store.checkpoints import (
    CheckpointTimeline,
    adapter_series_base,
    checkpoint_timeline,
    plan_series,
    resolve_series,
)

WINDOWS, WINDOW_TOKENS = 2, 256  # the fixed token set per domain: small, so a series runs in seconds
SETTINGS = TraceSettings(batch_size=WINDOWS, chunk_tokens=WINDOW_TOKENS)


def sample_series() -> list[str]:
    """Sample checkpoint series: the folders of the samples named `<series>/step-*`."""
    names = {name.split("/")[0] for name in moeviz.list_samples() if "/" in name}
    return [str(sample_models_dir() / name) for name in sorted(names)]


def series_picker() -> tuple[str, str | None]:
    """Sidebar: a sample series or a typed folder of checkpoint folders (inside `MOEVIZ_MODEL_DIRS`), and for
    a folder of adapters its base model (`base_picker`); → (that folder, the base source or None). Errors
    stop the page."""
    choices = sample_series()
    with st.sidebar:
        options = [*choices, access.LOCAL_FOLDER]
        choice = st.selectbox(
            "Checkpoint series", options, key="series_choice", format_func=lambda p: Path(p).name
        )
        series = choice
        if choice == access.LOCAL_FOLDER:
            series = st.text_input(
                "Series folder",
                key="series_folder",
                help="A folder of checkpoint folders (each with config.json), or of the adapters a "
                "fine-tune saved every N steps (checkpoint-N, each with adapter_config.json).",
            )
    with stop_on_error():
        series = series if series in choices else access.check_series(series or "")  # samples: allowed
    for part in series.split(","):
        if not Path(part).is_dir():
            st.error(f"{part} is not a folder")
            st.stop()
    with stop_on_error():
        declared = adapter_series_base(series)
    return series, None if declared is None else base_picker(declared)


def base_picker(declared: str) -> str:
    """Sidebar: the base model of an adapter series: a sample, the base the adapters declare (when it is a
    folder here, inside `MOEVIZ_MODEL_DIRS`) or a typed folder; → its model source. Errors stop the page."""
    options = access.sample_sources()
    try:
        if declared and (Path(declared) / "config.json").is_file():
            options = [access.check_source(declared), *options]  # offered first: the default
    except moeviz.MoevizError:
        pass  # outside the allowed folders: not offered
    # else the sample the declared base is named after (trained elsewhere from a copy of it)
    name = declared.rstrip("/").rsplit("/", 1)[-1]
    match = next((i for i, o in enumerate(options) if o == f"sample:{name}"), 0)
    with st.sidebar:
        choice = st.selectbox(
            "Base model",
            [*options, access.LOCAL_FOLDER],
            index=match,
            key="series_base",
            help=f"The model the adapters were trained on (their config names {declared or 'none'!r}); "
            "the base alone is the timeline's first checkpoint, 'base'.",
        )
        if choice == access.LOCAL_FOLDER:
            choice = st.text_input(
                "Base model folder", key="series_base_folder", help=access.roots_hint("model")
            )
    with stop_on_error():
        return access.check_source(choice or "")


@st.cache_resource(show_spinner=False, max_entries=4)
def series_store(series: str, base: str | None = None) -> str:
    """A store folder kept for the server's life, one per series (and base); its checkpoints are traced on
    demand."""
    return tempfile.mkdtemp(prefix="moeviz-app-timeline-")


@st.cache_resource(show_spinner=False, max_entries=4)
def small_corpus(series: str, first_folder: str) -> str:
    """The first WINDOWS × WINDOW_TOKENS tokens of each evaluation slice (the series' tokenizer), as a
    corpus folder: every checkpoint is traced on exactly these tokens."""
    folder = Path(tempfile.mkdtemp(prefix="moeviz-app-corpus-"))
    return str(write_eval_prefix(moeviz.load_model(first_folder), folder, WINDOWS * WINDOW_TOKENS))


@st.cache_resource(show_spinner=False, max_entries=64)
def traced_checkpoint(series: str, label: str, folder: str, index: int, base: str | None = None) -> str:
    """Trace one checkpoint of `series` into its store (once per server process; resumable); an adapter is
    merged into `base`."""
    plan = plan_series(series, base)
    write_corpus(
        moeviz.load_model(**plan.load_args(Path(folder))),
        small_corpus(series, str(plan.checkpoints[0][1])),
        series_store(series, base),
        model=plan.name,
        checkpoint=label,
        checkpoint_index=index,
        settings=SETTINGS,
        resume=True,
        progress=False,
    )
    return label


@st.cache_data(show_spinner=False, max_entries=8)
def timeline_of(series: str, base: str | None = None) -> CheckpointTimeline:
    """The timeline of a fully traced series (call after `traced_checkpoint` for every checkpoint)."""
    name, _ = resolve_series(series, base)
    return checkpoint_timeline(series_store(series, base), model=name)


@st.cache_data(show_spinner=False, max_entries=256)
def pair_lineage(folder_a: str, folder_b: str) -> tuple[bool, str]:
    """(related, reason) of two checkpoint folders (`moeviz.analysis.lineage`: config shape and router /
    expert weight cosine, read lazily from the safetensors files: milliseconds for the samples)."""
    result = lineage(Path(folder_a), Path(folder_b))
    return result.related, result.reason


def series_breaks(series: str, base: str | None = None) -> list[tuple[str, str, str]]:
    """(previous checkpoint, checkpoint, reason) for each checkpoint of `series` that does not share a
    training lineage with its predecessor (expert ids do not correspond across that pair); errors stop.
    Adapters over one base keep its expert ids: no break."""
    with stop_on_error():
        _, checkpoints = resolve_series(series, base)
    if base is not None:
        return []
    breaks = []
    for (before, folder_a), (after, folder_b) in itertools.pairwise(checkpoints):
        try:
            related, reason = pair_lineage(str(folder_a), str(folder_b))
        except Exception as exc:  # unreadable weights: trace anyway, say the check did not run
            st.caption(f"Lineage of {before} → {after} not checked ({exc}).")
            continue
        if not related:
            breaks.append((before, after, reason))
    return breaks


def run_timeline(series: str, base: str | None = None) -> CheckpointTimeline:
    """Trace every checkpoint (an adapter merged into `base`), then compute the timeline; errors stop.
    Progress: a bar and a status block with one line per checkpoint (kept, collapsed, once done)."""
    with stop_on_error():
        _, checkpoints = resolve_series(series, base)
        n = len(checkpoints)
        bar = st.progress(0.0, text="Tracing the checkpoints…")
        with st.status(f"Tracing {n} checkpoints…", expanded=True) as status:
            for i, (label, folder) in enumerate(checkpoints):
                bar.progress(i / n, text=f"Tracing checkpoint {label} ({i + 1}/{n})…")
                traced_checkpoint(series, label, str(folder), i, base)
                st.write(f"Traced checkpoint {label} ({i + 1}/{n})")
            bar.progress(1.0, text="Comparing the checkpoints…")
            timeline = timeline_of(series, base)
            status.update(label=f"Traced {n} checkpoints", state="complete", expanded=False)
        bar.empty()
        return timeline


def timeline_table(timeline: CheckpointTimeline) -> pd.DataFrame:
    """Per checkpoint × layer: balance, verdict and saturation, in training order."""
    return (
        timeline.collapse.merge(
            timeline.saturation.drop(columns="tokens"),
            on=["checkpoint", "order", "site", "layer"],
            how="left",
        )
        .sort_values(["order", "site", "layer"])
        .reset_index(drop=True)
    )
