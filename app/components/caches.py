"""The server-wide caches: one loaded model per model key, the captures per (model key, text), each
session's trace copies and the Routing page's frames; and loading them with a progress bar.

The example prompt's routing is also kept on disk per model key (`moeviz.trace.kept`), and ships with the
bundled samples (`moeviz.models.bundled_examples`): a new server shows it without loading torch or the
model (the first page), which load when a view needs them.

A model key is the source plus its load options (`load_options`: dtype, device, device map), so loads at
two dtypes never share a model or a capture. One loaded model per key is kept for the whole server process
and shared by every session (`models`); captured traces are cached per (model key, text) (`TraceCache`)
and are thread-safe in the library, so concurrent sessions never see each other's routing. No model math
here: everything goes through `moeviz`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import streamlit as st

import moeviz
from components import access, load_options, prompt, warmup
from components.errors import stop_on_error
from components.routing_frames import RoutingFrames, ScaleFrames, frames_for
from components.trace_cache import SharedResults, TraceCache
from moeviz.analysis.null import load_confidence
from moeviz.attention import AttentionCapture
from moeviz.models.bundled_examples import bundled_trace
from moeviz.models.sources import resolve_source
from moeviz.samples import DOMAINS, eval_batch
from moeviz.trace.finite import routing_warning
from moeviz.trace.kept import keep_trace, kept_trace, trace_key


def load_for_key(key: str, progress: Callable[[int, int], None] | None = None) -> moeviz.LoadedModel:
    """Load the model of a model key (`load_options`: the source and its dtype, device and device map)."""
    source, options = load_options.split_key(key)
    return moeviz.load_model(access.check_source(source), progress=progress, **options.load_kwargs())


@st.cache_resource
def models() -> SharedResults[str, moeviz.LoadedModel]:
    """The server's loaded models, the 4 latest model keys. Not `st.cache_resource` on the load itself: a
    cached function replays the elements it drew on later hits, and a load draws its progress bar."""
    return SharedResults(size=4)


def get_model(key: str) -> moeviz.LoadedModel:
    """The model of a model key (a source, with its load options if not the defaults), loaded once per server
    process and shared by all sessions; its first load shows the weights read in a progress bar."""
    bar = None

    def progress(done: int, total: int) -> None:
        nonlocal bar
        text = f"Loading weights: {done / 2**20:,.1f} of {total / 2**20:,.1f} MiB"
        fraction = min(done / total, 1.0) if total else 0.0
        if bar is None:
            bar = st.progress(fraction, text=text)
        else:
            bar.progress(fraction, text=text)

    if not warmup.done():
        with st.spinner("Starting moeviz: loading torch and transformers (once per server)…", show_time=True):
            warmup.wait()
    cache = models()
    try:
        if key in cache.cached_keys():
            return cache.get(key, lambda: load_for_key(key, progress))
        with st.spinner("Loading the model…"):  # reading the config and sizing it, before the first bytes
            return cache.get(key, lambda: load_for_key(key, progress))
    finally:
        if bar is not None:
            bar.empty()


@st.cache_resource
def captures() -> TraceCache:
    """The server's trace cache. Not `st.cache_resource` on the capture itself: a cached function replays
    the elements it drew on later hits, and a capture draws its progress bar while it runs."""
    return TraceCache(get_model, size=8)


def captured(source: str, text: str, progress: Callable[[int, int], None] | None = None) -> moeviz.Trace:
    """One forward of `text` with routing and (decoder-only models) attention, per (model, text)."""
    return captures().get(source, text, progress)


def example_folder(source: str, text: str) -> Path | None:
    """The model folder of the model key `source` when `text` is the example prompt; None for any other
    text (only the example is kept or bundled: the first page's)."""
    if text != prompt.EXAMPLE_PROMPT:
        return None
    model_source, _ = load_options.split_key(source)
    return resolve_source(access.check_source(model_source))


@st.cache_resource(show_spinner=False, max_entries=8)
def kept_example(source: str, text: str) -> moeviz.Trace | None:
    """The routing of `text` by the model key `source` kept on disk (`moeviz.trace.kept`) or bundled with
    the sample (`moeviz.models.bundled_examples`), or None; looked up once per server (a capture made later
    is the same routing, and the caches keep it)."""
    folder = example_folder(source, text)
    if folder is None:
        return None
    kept = kept_trace(trace_key(folder, text, options=source))
    return kept if kept is not None else bundled_trace(folder, text, options=source)


@st.cache_resource(show_spinner=False, max_entries=8)
def keep_example(source: str, text: str) -> Path | None:
    """Keep the routing of `text` just captured on disk when it is the example prompt's (once per server
    and key); the file, or None."""
    folder = example_folder(source, text)
    if folder is None:
        return None
    trace = dataclasses.replace(captured(source, text), attention=None)
    return keep_trace(trace_key(folder, text, options=source), trace)


@st.cache_data(show_spinner=False, max_entries=64)
def get_trace(source: str, text: str) -> moeviz.Trace:
    """Routing of `text` through the model at `source` (cached per model and text; each session gets
    its own copy): the kept example (`kept_example`) or a capture. Attention is left out here: see
    `get_attention`."""
    kept = kept_example(source, text)
    return kept if kept is not None else dataclasses.replace(captured(source, text), attention=None)


@st.cache_resource(show_spinner=False, max_entries=8)
def routing_frames(source: str, text: str) -> RoutingFrames | ScaleFrames:
    """The Routing page's frames of `text` (`routing_frames.frames_for`: per layer, built on use, over 20
    experts), built once and shared (read-only: pages only select from them; a per-session copy would cost
    an unpickling of a million rows on every click of a 32k-token input)."""
    return frames_for(get_trace(source, text))


@st.cache_data(show_spinner=False, max_entries=64)
def layer_load_bands(
    source: str, text: str, site: str, layer: int, _routing: moeviz.LayerRouting, draws: int = 2000
) -> tuple[pd.DataFrame, dict[str, tuple[float, float, float]]]:
    """Bootstrap bands (90%) of one layer's load (`moeviz.analysis.null.load_confidence`, `draws`
    resamples of the tokens): the per-expert shares (columns expert, share, share_low, share_high) and the
    indicators' (value, low, high). Cached per (model key, text, layer, draws); `_routing` is that layer of
    the trace (not hashed). 2000 draws of 1000 tokens × 256 experts take ~0.5 s, 400 draws ~0.06 s."""
    band = load_confidence(_routing, draws=draws)
    experts = pd.DataFrame(
        {
            "expert": range(len(band.share)),
            "share": band.share,
            "share_low": band.share_low,
            "share_high": band.share_high,
        }
    )
    return experts, band.indicators


def get_attention(source: str, text: str) -> AttentionCapture | None:
    """The attention capture of `text` (None for models without one), shared by all sessions."""
    with stop_on_error():
        return captured(source, text).attention


def load_or_stop(source: str, text: str) -> moeviz.Trace:
    """The routing of `text`: the kept example (`kept_example`), or load and capture (keeping the example),
    showing a library error as a message (never a traceback) and stopping the page."""
    with stop_on_error():
        if kept_example(source, text) is None:
            get_model(source)
            bar = st.empty()

            def progress(done: int, total: int) -> None:
                text = f"Routing the prompt through the model: MoE layer {done} of {total}…"
                bar.progress(done / total, text=text)

            captured(source, text, progress)
            bar.empty()
            keep_example(source, text)
        trace = get_trace(source, text)
    warn_if_implausible(trace, trace_warning(source, text, trace))
    return trace


@st.cache_data(show_spinner=False, max_entries=64)
def trace_warning(source: str, text: str, _trace: moeviz.Trace) -> str | None:
    """The library's warning about the routing of `text` (router scores that are not finite, naming the
    layers), None if none; per (model key, text): `_trace` is that capture (not hashed)."""
    return routing_warning(_trace.layers)


def warn_if_implausible(trace: moeviz.Trace, message: str | None) -> None:
    """Show the library's warning about a trace's routing (`trace_warning`) above the page's views."""
    if message is not None:
        st.warning(f"{trace.model.source}: {message}", icon=":material/warning:")


@st.cache_data(show_spinner=False, max_entries=16)
def get_domain_trace(source: str, domain: str) -> moeviz.Trace:
    """Routing of one domain of the sample evaluation corpus (8 windows × 256 tokens), cached."""
    loaded = get_model(source)
    batch = eval_batch(loaded)
    ids = [ids for ids, d in zip(batch.token_ids, batch.domains, strict=True) if d == domain]
    return moeviz.capture(loaded, token_ids=ids)


def corpus_trace(source: str) -> moeviz.Trace:
    """The evaluation corpus (all domains) routed through the model, with a progress bar per domain."""
    with stop_on_error():
        get_model(source)  # with its progress bar: the per-domain captures show none
    bar = st.progress(0.0, text="Routing the evaluation corpus…")
    parts = []
    with stop_on_error():
        try:
            for i, domain in enumerate(DOMAINS):
                bar.progress(i / len(DOMAINS), text=f"Routing the evaluation corpus: {domain}…")
                parts.append(get_domain_trace(source, domain))
        finally:
            bar.empty()
    trace = moeviz.Trace.concat(parts)
    warn_if_implausible(trace, routing_warning(trace.layers))
    return trace
