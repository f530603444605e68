"""Routing files in the app: a moeviz routing file (`moeviz capture --out`, `moeviz import --out`: a Trace, or
an engine's expert counts, an `ExpertLoad`) typed as a path or uploaded, read once and shared read-only.

A typed path opens only inside the store folders this server may open (`access.folder_inside`, as the Corpus
page's store); an upload holds at most `prompt.PROMPT_FILE_LIMIT` bytes (the app's upload limit). Files are
read with `moeviz.trace.read_routing_file` (Parquet only: nothing is unpickled). The Engines page picks its
two sides with these widgets, every page that reads routing its input (`page_input`). No model math here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import tempfile
from pathlib import Path

import streamlit as st

import moeviz
from components import access, prompt
from components.errors import stop_on_error
from components.widgets import keep
from moeviz.errors import InputError
from moeviz.trace import ExpertLoad

PATH, UPLOAD = "path", "upload"
KINDS = {PATH: "a routing file (path)", UPLOAD: "an uploaded routing file"}


@dataclasses.dataclass(frozen=True)
class RoutingFile:
    """A routing file on a page: `ident` is what the caches key on (the resolved path, size and mtime of a
    typed path; the digest of an upload), `name` how the page names it (the file's name), `where` how
    messages name it (the resolved path; an upload's name), `routing` its content."""

    kind: str
    ident: str
    name: str
    where: str
    routing: moeviz.Trace | ExpertLoad


def routing_path(text: str) -> Path:
    """A routing file typed on a page, resolved (symlinks followed): inside `MOEVIZ_STORE_DIRS` when that is
    set (`access.FolderNotAllowedError` with the allowlist's message otherwise), and an existing file."""
    if not text.strip():
        raise InputError(
            "enter the path of a routing file (.parquet, from `moeviz capture` or `moeviz import`)"
        )
    path = access.folder_inside(text.strip(), "store")
    if not path.is_file():
        raise InputError(f"{path} is not a file")
    return path


@st.cache_resource(show_spinner=False, max_entries=8)
def read_path(ident: str, path: str) -> moeviz.Trace | ExpertLoad:
    """The routing file at `path`, read once per `ident` (path, size, mtime) and shared read-only."""
    from moeviz.trace import read_routing_file

    return read_routing_file(path)


@st.cache_resource(show_spinner=False, max_entries=8)
def read_upload(ident: str, name: str, _data: bytes) -> moeviz.Trace | ExpertLoad:
    """An uploaded routing file, read once per `ident` (its digest); messages name the upload, not the
    temporary file it is read from."""
    from moeviz.trace import read_routing_file

    with tempfile.TemporaryDirectory(prefix="moeviz-routing-") as folder:
        path = Path(folder) / "upload.parquet"
        path.write_bytes(_data)
        try:
            return read_routing_file(path)
        except moeviz.MoevizError as exc:
            raise type(exc)(str(exc).replace(str(path), name)) from None


def check_upload(name: str, data: bytes) -> None:
    """InputError unless a .parquet file within the app's upload limit."""
    if not name.lower().endswith(".parquet"):
        raise InputError(
            f"{name} is not a routing file: upload a .parquet file from `moeviz capture --out` or "
            "`moeviz import --out`"
        )
    limit = prompt.PROMPT_FILE_LIMIT
    if len(data) > limit:
        raise InputError(
            f"{name} has {len(data):,} bytes; uploads may have at most {limit:,} ({limit >> 20} MiB): give a "
            "larger file by its path"
        )


def kept_text(label: str, store_key: str, **kwargs) -> str:
    """A text input whose value survives page switches (`st.session_state[store_key]`)."""
    widget_key = f"{store_key}_widget"
    st.session_state[widget_key] = st.session_state.get(store_key, "")
    return st.text_input(label, key=widget_key, on_change=keep, args=(widget_key, store_key), **kwargs)


def pick_file(kind: str, prefix: str, label: str, missing: str = "Upload a routing file.") -> RoutingFile:
    """The widget of a routing file of `kind` (PATH: a text input; UPLOAD: an uploader, its file kept across
    page switches), its values kept under `prefix`; the file read (cached). A bad path or file stops the
    page with its message; nothing typed or uploaded yet stops it with a hint (`missing` for an upload)."""
    if kind == PATH:
        typed = kept_text(
            label,
            f"{prefix}_path",
            placeholder="/data/rollout/routes.parquet",
            help="A .parquet routing file from `moeviz capture --out` or `moeviz import --out`. "
            + access.roots_hint("store"),
        )
        if not (typed or "").strip():  # nothing typed yet: a hint, not an error
            st.info(
                "Enter the path of a routing file (.parquet, from `moeviz capture --out` or `moeviz import "
                "--out`) and press Enter.",
                icon=":material/description:",
            )
            st.stop()
        with stop_on_error():
            path = routing_path(typed)
            stat = path.stat()
            ident = f"{path}|{stat.st_size}|{stat.st_mtime_ns}"
            return RoutingFile(kind, ident, path.name, str(path), read_path(ident, str(path)))
    upload = st.file_uploader(
        f"{label} (.parquet, up to {prompt.PROMPT_FILE_LIMIT >> 20} MiB)",
        key=f"{prefix}_upload",
        # no `type=`: a file the browser refused never reaches the server, so nothing could say why
    )
    if upload is not None:  # kept across page switches (an uploader forgets its file)
        st.session_state[f"{prefix}_upload_kept"] = (upload.name, upload.getvalue())
    kept_upload = st.session_state.get(f"{prefix}_upload_kept")
    if kept_upload is None:
        st.info(missing, icon=":material/upload_file:")
        st.stop()
    name, data = kept_upload
    with stop_on_error():
        check_upload(name, data)
        ident = hashlib.sha256(data).hexdigest()
        return RoutingFile(kind, ident, name, name, read_upload(ident, name, data))
