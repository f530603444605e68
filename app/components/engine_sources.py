"""The Engines page's two routing sources and what it computes from them, cached.

A source is the sidebar model captured on the prompt at a chosen dtype (the app's shared loads and captures,
`caches`, keyed by the model key with that dtype: `dtype_key`), the sidebar model run in vLLM on the prompt
at a chosen dtype (`vllm_source`: the server's one vLLM worker, its captures shared by all sessions) or a
routing file, typed as a path or uploaded (`routing_files`: the app's shared file picking, the allowlist and
the upload limit); a file must hold per-token routing (`as_routing`: an expert-count table cannot be
diffed). The diff (`moeviz.analysis.engine_diff`) is cached per pair of sources, the replay
(`moeviz.interventions.replay`) kept in the session per pair. No model math here.
"""

from __future__ import annotations

import dataclasses

import streamlit as st

import moeviz
from components import caches, load_options, routing_files, vllm_source
from components.errors import stop_on_error
from components.routing_files import PATH, UPLOAD, check_upload  # noqa: F401 (check_upload: the page's API)
from components.widgets import kept
from moeviz.analysis.engine_diff import EngineDiff, engine_diff, is_capture
from moeviz.errors import InputError
from moeviz.trace import ExpertLoad

CAPTURE, VLLM = "capture", "vllm"
KINDS = {CAPTURE: "capture this model", VLLM: "run this model in vLLM", **routing_files.KINDS}
DTYPES = ["float32", "bfloat16", "float16"]
DEFAULT_DTYPES = {"A": "bfloat16", "B": "float32"}  # the first view: bf16 vs fp32 of the sidebar model
REPLAYS = "engines_replays"  # session: {(source A id, source B id, model key): Replay}


@dataclasses.dataclass(frozen=True)
class Source:
    """One side of the diff. `ident` is what the caches key on (the model key and prompt of a capture; the
    model source, dtype and prompt of a vLLM run; the resolved path, size and mtime of a file; the digest of
    an upload); `model_key` is the capture's model key (None for a vLLM run and a file: neither can be
    reloaded in transformers as it ran); `model` the model source vLLM runs; `label` names it on the page;
    `trace` is its routing."""

    side: str
    kind: str
    ident: str
    label: str
    trace: moeviz.Trace | None  # None until `load` captures it
    model_key: str | None = None
    dtype: str | None = None
    model: str | None = None


def dtype_key(model_key: str, dtype: str) -> str:
    """The model key of the sidebar model (its other load options kept) loaded at `dtype`."""
    source, options = load_options.split_key(model_key)
    return dataclasses.replace(options, dtype=dtype).key(source)


def as_routing(routing, name: str) -> moeviz.Trace:
    """The per-token routing of a file's content; InputError for an expert-count table (no tokens)."""
    if isinstance(routing, ExpertLoad):
        raise InputError(
            f"{name} holds expert counts ({routing.source}), not per-token routing: a diff needs which "
            "experts each token chose"
        )
    return routing


def source_picker(side: str, model_key: str, text: str) -> Source:
    """The widgets of one side (each choice survives page switches) and its routing: a capture (with the
    app's progress bars), a file or an upload; a bad choice stops the page with its message."""
    prefix = f"engines_{side.lower()}"
    st.session_state.setdefault(f"{prefix}_dtype", DEFAULT_DTYPES[side])
    kind = kept(
        f"{prefix}_kind",
        list(KINDS),
        st.selectbox,
        f"Source {side}",
        list(KINDS),
        format_func=KINDS.get,
        help="The sidebar model on the prompt at a dtype (captured by moeviz in transformers, or run in "
        "vLLM: the routing vLLM dispatched), or a moeviz routing file (`moeviz capture --out`, `moeviz "
        "import --out`).",
    )
    if kind == VLLM:
        return vllm_picker(side, prefix, model_key)
    if kind == CAPTURE:
        dtype = kept(
            f"{prefix}_dtype",
            DTYPES,
            st.selectbox,
            f"dtype of {side}",
            DTYPES,
            help="The model loaded at this dtype (its other load options as in the sidebar); router scores "
            "are computed in fp32 either way.",
        )
        return Source(side, kind, "", f"this model at {dtype}", None, dtype_key(model_key, dtype), dtype)
    picked = routing_files.pick_file(
        kind, prefix, f"Routing file of {side}", missing=f"Upload a routing file for {side}."
    )
    with stop_on_error():
        trace = as_routing(picked.routing, picked.where)
    return Source(side, kind, picked.ident, picked.name, trace)


def vllm_picker(side: str, prefix: str, model_key: str) -> Source:
    """The dtype of a vLLM side (kept with the capture's: switching the kind keeps it); where the vLLM
    environment is absent, what installs it, and the page stops."""
    dtype = kept(
        f"{prefix}_dtype",
        DTYPES,
        st.selectbox,
        f"dtype of {side} in vLLM",
        DTYPES,
        help="vLLM runs the model at this dtype (its `LLM(dtype=…)`); the routing is the experts vLLM's own "
        "router chose and dispatched.",
    )
    hint = vllm_source.environment_hint()
    if hint is not None:
        st.warning(f"{side} cannot run yet: {hint}.", icon=":material/download:")
        st.stop()
    source, options = load_options.split_key(model_key)
    placement = {name: value for name, value in options.changed().items() if name != "dtype"}
    if placement:
        settings = ", ".join(f"{name}={value}" for name, value in placement.items())
        st.caption(
            f"vLLM loads and places the model itself, with its own settings (its CPU build: on the CPU); the "
            f"sidebar's {settings} apply to moeviz's captures only."
        )
    return Source(side, VLLM, "", f"this model in vLLM at {dtype}", None, None, dtype, model=source)


def load(source: Source, text: str) -> Source:
    """A capture side with its trace (the app's cached load and capture of the prompt, with progress bars);
    a vLLM side with the routing vLLM dispatched (the server's shared vLLM captures, with its progress); a
    file side as it is."""
    if source.kind == VLLM:
        retry = f"engines_{source.side.lower()}_vllm_retry"
        trace = vllm_source.trace(source.model, source.dtype, text, retry_key=retry)
        return dataclasses.replace(source, ident=f"vllm|{source.model}|{source.dtype}|{text}", trace=trace)
    if source.kind != CAPTURE:
        return source
    trace = caches.load_or_stop(source.model_key, text)
    return dataclasses.replace(source, ident=f"{source.model_key}|{text}", trace=trace)


@st.cache_resource(show_spinner=False, max_entries=8)
def diff_of(ident_a: str, ident_b: str, _a: moeviz.Trace, _b: moeviz.Trace) -> EngineDiff:
    """`engine_diff(A, B)`, once per pair of sources (shared read-only)."""
    return engine_diff(_a, _b)


def replay_models(a: Source, b: Source, model_key: str) -> tuple[str, str | None]:
    """(model key the replay runs in, model key of A as it ran or None): B's when B is a capture of this
    model, else the sidebar's; A's own when A is a capture (then the gap is measured against A's log-probs),
    else None (the shift A's routing causes)."""
    train = b.model_key if b.model_key is not None else model_key
    infer = a.model_key if a.model_key is not None and is_capture(a.trace) else None
    return train, infer
