"""Corpus: routing at corpus scale from a Parquet store — load, balance and domain specialisation."""

import tempfile
import threading
from pathlib import Path

import state
import streamlit as st

import moeviz
from moeviz.charts import balance_chart, load_heatmap
from moeviz.charts.checkpoints import domain_specialisation_heatmap
from moeviz.samples import DOMAINS, write_eval_prefix
from moeviz.store import StoreError, StoreQuery, TraceSettings, trace_corpus

BUILD = "Build a small store from the evaluation corpus"
OPEN = "Open a store folder…"
WINDOWS = 2  # windows of 256 tokens per evaluation domain: a few seconds on the CPU


def check_store(text: str) -> str:
    """A store folder, resolved (symlinks followed) and inside `MOEVIZ_STORE_DIRS` when that is set."""
    if not text.strip():
        raise moeviz.MoevizError("enter the path of a store folder (made by `moeviz trace --out`)")
    folder = state.folder_inside(text.strip(), "MOEVIZ_STORE_DIRS", "store")
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
    loaded = state.get_model(source)
    corpus = write_eval_prefix(loaded, Path(tempfile.mkdtemp(prefix="moeviz-app-corpus-")), WINDOWS * 256)
    store = tempfile.mkdtemp(prefix="moeviz-app-store-")
    settings = TraceSettings(batch_size=WINDOWS, chunk_tokens=256)
    total = len(DOMAINS) * WINDOWS // settings.batch_size

    def step(batch) -> None:
        bar.progress(min((batch.index + 1) / total, 1.0), text=f"Tracing batch {batch.index + 1}…")

    label = source.removeprefix(state.SAMPLE_PREFIX).replace("/", "-")
    trace_corpus(loaded, corpus, store, model=label, settings=settings, progress=False, on_batch=step)
    return store


def options(query: StoreQuery, field: str) -> list:
    return sorted({getattr(r, field) for r in query.runs})


st.title("Corpus")
mode = st.radio("Store", [BUILD, OPEN], horizontal=True, key="corpus_mode")
with state.stop_on_error():
    if mode == BUILD:
        source = state.model_picker()
        st.caption(
            f"The first {WINDOWS} × 256 tokens of each domain of sample_models/eval, traced into a "
            "temporary store with the chosen model."
        )
        store = sample_store(source)
    else:
        hint = state.roots_hint("MOEVIZ_STORE_DIRS")
        store = check_store(st.text_input("Store folder", key="store_folder", help=hint))
    full = StoreQuery(store)
if not full.runs:
    st.warning("The store holds no traced run.")
    st.stop()
st.dataframe(full.summary(), hide_index=True)

a, b, c, d = st.columns(4)
model = a.selectbox("Model", options(full, "model"), key="corpus_model")
checkpoints = [r.checkpoint for r in full.runs if r.model == model]
checkpoint = b.selectbox("Checkpoint", checkpoints, index=len(checkpoints) - 1, key="corpus_checkpoint")
scope = StoreQuery(store, model=model, checkpoint=checkpoint, validate=False)
domains = scope.sql("SELECT DISTINCT domain FROM rows ORDER BY domain")["domain"].tolist()
layers = scope.sql("SELECT DISTINCT layer FROM rows ORDER BY layer")["layer"].astype(int).tolist()
chosen_domains = c.multiselect("Domains", domains, key="corpus_domains", placeholder="all")
chosen_layers = d.multiselect("Layers", layers, key="corpus_layers", placeholder="all")
query = StoreQuery(
    store,
    model=model,
    checkpoint=checkpoint,
    domain=chosen_domains or None,
    layer=chosen_layers or None,
    validate=False,
)

st.subheader("Load per layer and expert")
load = query.expert_load()
load["dead"] = load["count"] == 0
state.show_chart(load_heatmap(load), "corpus_load")
st.caption("Tokens each expert received over its fair share (white = fair, red = over, blue = under).")
state.table_downloads(load, "corpus_expert_load")

st.subheader("Balance per layer")
balance = query.balance()
indicator = st.selectbox(
    "Indicator", ["load_entropy", "max_share", "dead_fraction", "cv", "gini", "jain"], key="corpus_metric"
)
state.show_chart(balance_chart(balance, indicator), "corpus_balance")
st.caption("One balance indicator per layer; the dashed tick is its value under perfectly even load.")
verdicts = query.collapse()
st.dataframe(verdicts, hide_index=True)
state.table_downloads(balance, "corpus_balance")
state.table_downloads(verdicts, "corpus_collapse")

st.subheader("Domain specialisation")
spec = query.domain_specialisation()
state.show_chart(domain_specialisation_heatmap(spec), "corpus_specialisation")
st.caption("How much more often each expert is chosen for a domain's tokens than chance (lift = DS / (k/E)).")
state.table_downloads(spec, "corpus_domain_specialisation")
