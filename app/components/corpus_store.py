"""The Corpus page's store: a folder opened from the allowed roots, or a small store built once per server
from the sample evaluation corpus with the chosen model."""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path

import streamlit as st

import moeviz
from components import access, caches, load_options, pickers
from components.errors import stop_on_error
from moeviz.samples import DOMAINS, write_eval_prefix
from moeviz.store import StoreError, StoreQuery, TraceSettings, write_corpus
from moeviz.store.writer import default_label

BUILD = "Build a small store from the evaluation corpus"
OPEN = "Open a store folder…"
WINDOWS = 2  # windows of 256 tokens per evaluation domain: a few seconds on the CPU


def check_store(text: str) -> str:
    """A store folder, resolved (symlinks followed) and inside `MOEVIZ_STORE_DIRS` when that is set."""
    if not text.strip():
        raise moeviz.MoevizError("enter the path of a store folder (made by `moeviz trace --out`)")
    folder = access.folder_inside(text.strip(), "store")
    if not folder.is_dir():
        raise StoreError(f"{folder} is not a folder")
    return str(folder)


@st.cache_resource
def built_stores() -> tuple[dict[str, str], threading.Lock]:
    """Sample stores already built in this server process (model source → folder), and their lock."""
    return {}, threading.Lock()


def sample_store(source: str) -> str:
    """A store of `source` over the first WINDOWS × 256 tokens of each evaluation domain, built once per
    server with a progress bar (not `st.cache_resource`: a cached function cannot update a bar)."""
    stores, lock = built_stores()
    with lock:
        if source not in stores:
            bar = st.progress(0.0, text="Tracing the evaluation corpus into a store…")
            stores[source] = _build_sample_store(source, bar)
            bar.empty()
    return stores[source]


def _build_sample_store(source: str, bar) -> str:
    loaded = caches.get_model(source)
    corpus = write_eval_prefix(loaded, Path(tempfile.mkdtemp(prefix="moeviz-app-corpus-")), WINDOWS * 256)
    store = tempfile.mkdtemp(prefix="moeviz-app-store-")
    settings = TraceSettings(batch_size=WINDOWS, chunk_tokens=256)
    total = len(DOMAINS) * WINDOWS // settings.batch_size

    def step(batch) -> None:
        bar.progress(min((batch.index + 1) / total, 1.0), text=f"Tracing batch {batch.index + 1}…")

    text = load_options.source_of(source)
    label = text.removeprefix(access.SAMPLE_PREFIX).replace("/", "-")  # sample:series/step, org/name
    if Path(text).is_dir():  # a local folder: its name (a full path is no store label)
        label = default_label(text)
    write_corpus(loaded, corpus, store, model=label, settings=settings, progress=False, on_batch=step)
    return store


def store_picker() -> StoreQuery:
    """Build a sample store (with the sidebar's model) or open a store folder; → a query over all of it.
    Errors stop the page."""
    mode = st.radio("Store", [BUILD, OPEN], horizontal=True, key="corpus_mode")
    with stop_on_error():
        if mode == BUILD:
            source = pickers.model_picker()
            st.caption(
                f"The first {WINDOWS} × 256 tokens of each domain of sample_models/eval, traced into a "
                "temporary store with the chosen model."
            )
            store = sample_store(source)
        else:
            hint = access.roots_hint("store")
            store = check_store(st.text_input("Store folder", key="store_folder", help=hint))
        return StoreQuery(store)


def run_options(query: StoreQuery, field: str) -> list:
    """The distinct values of one field (model, checkpoint, …) of the store's runs, sorted."""
    return sorted({getattr(r, field) for r in query.runs})
