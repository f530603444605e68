"""What the app pages share: which models may be opened, the model picker, and cached loading and capture.

One loaded model per source is kept for the whole server process and shared by every session
(`st.cache_resource`); captures are cached per (model, text) and are thread-safe in the library, so
concurrent sessions never see each other's routing. No model math here: everything goes through `moeviz`.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import streamlit as st

import moeviz
from moeviz.errors import ModelSourceError
from moeviz.models.loading import DEFAULT_SAMPLE

SAMPLE_PREFIX = "sample:"
FALLBACK_MODEL = DEFAULT_SAMPLE
LOCAL_FOLDER = "Local folder…"
EXAMPLE_PROMPT = (
    "The for statement is used to iterate over the elements of a sequence (such as a string, tuple or list)."
)


class FolderNotAllowedError(ModelSourceError):
    """The folder lies outside the roots this server was told to serve (`MOEVIZ_MODEL_DIRS`)."""


def model_roots() -> list[Path] | None:
    """Folders local models may be opened from (`MOEVIZ_MODEL_DIRS`, os.pathsep-separated); None = any."""
    raw = os.environ.get("MOEVIZ_MODEL_DIRS", "")
    roots = [Path(part).expanduser().resolve() for part in raw.split(os.pathsep) if part.strip()]
    return roots or None


def default_model() -> str:
    """`MOEVIZ_DEFAULT_MODEL` if set, else the healthy Mixtral sample."""
    return os.environ.get("MOEVIZ_DEFAULT_MODEL", "").strip() or FALLBACK_MODEL


def check_source(source: str) -> str:
    """Normalise a model source; a folder must resolve (symlinks followed) inside `model_roots()`."""
    text = source.strip()
    if text.startswith(SAMPLE_PREFIX):
        return text
    if not text:
        raise ModelSourceError("enter the path of a local Hugging Face model folder")
    folder = Path(text).expanduser().resolve()
    roots = model_roots()
    if roots is not None and not any(folder.is_relative_to(root) for root in roots):
        allowed = ", ".join(str(root) for root in roots)
        raise FolderNotAllowedError(f"{folder} is outside the model folders this server may open ({allowed})")
    return str(folder)


def model_picker() -> str:
    """Sidebar: pick a sample or type a local folder. Returns the checked source; stops the page on error."""
    samples = [f"{SAMPLE_PREFIX}{name}" for name in moeviz.list_samples()]
    choices = [*samples, LOCAL_FOLDER]
    default = default_model()
    if "model_choice" not in st.session_state:
        if default.startswith(SAMPLE_PREFIX):
            st.session_state["model_choice"] = default if default in samples else choices[0]
        else:
            st.session_state["model_choice"] = LOCAL_FOLDER
            st.session_state["model_folder"] = default
    with st.sidebar:
        choice = st.selectbox("Model", choices, key="model_choice")
        source = choice
        if choice == LOCAL_FOLDER:
            roots = model_roots()
            hint = "Any local folder." if roots is None else "Inside: " + ", ".join(map(str, roots))
            source = st.text_input("Model folder", key="model_folder", help=f"A Hugging Face folder. {hint}")
    try:
        return check_source(source or "")
    except ModelSourceError as exc:
        st.error(str(exc))
        st.stop()


@st.cache_resource(show_spinner="Loading the model…", max_entries=4)
def get_model(source: str) -> moeviz.LoadedModel:
    """The model for `source`, loaded once per server process and shared by all sessions."""
    return moeviz.load_model(check_source(source))


@st.cache_data(show_spinner="Routing the prompt through the model…", max_entries=64)
def get_trace(source: str, text: str) -> moeviz.Trace:
    """Routing of `text` through the model at `source` (cached per model and text)."""
    return moeviz.capture(get_model(source), text)


def load_or_stop(source: str, text: str) -> moeviz.Trace:
    """Load and capture, showing a library error as a message (never a traceback) and stopping the page."""
    try:
        get_model(source)
        return get_trace(source, text)
    except moeviz.MoevizError as exc:
        st.error(str(exc))
        st.stop()


def layer_options(keys: list[tuple[str, int]]) -> dict[str, tuple[str, int]]:
    """Slider labels of the MoE layers → (site, layer); the site is named only when a model has several."""
    several = len({site for site, _ in keys}) > 1
    return {(f"{layer} ({site})" if several else str(layer)): (site, layer) for site, layer in keys}


def remember(widget_key: str, store_key: str, options: list) -> None:
    """Give widget `widget_key` the value kept under `store_key` (kept across reruns and page switches),
    or the first option when that value is not offered."""
    kept = st.session_state.get(store_key)
    if st.session_state.get(widget_key) not in options:
        st.session_state[widget_key] = kept if kept in options else options[0]


def routing_csv(trace: moeviz.Trace) -> Callable[[], bytes]:
    """Deferred CSV of the routing table (built only when the download is clicked)."""
    return lambda: trace.routing_frame().to_csv(index=False).encode()


def routing_parquet(trace: moeviz.Trace) -> Callable[[], bytes]:
    """Deferred Parquet of the routing table, as a moeviz trace file (adds each row's router logits and
    metadata; `moeviz.Trace.from_parquet` reads it back, pandas reads it as a table)."""

    def build() -> bytes:
        with tempfile.TemporaryDirectory() as tmp:
            return trace.to_parquet(Path(tmp) / "routing.parquet").read_bytes()

    return build
