"""The prompt: the same form on every page (typed or from a text file), kept across page switches, and the
choice between the prompt and the sample evaluation corpus."""

from __future__ import annotations

import streamlit as st

import moeviz
from components import caches
from components.widgets import toggle

EXAMPLE_PROMPT = (
    "The for statement is used to iterate over the elements of a sequence (such as a string, tuple or list)."
)
PROMPT_FILE_LIMIT = 1 << 20  # bytes of an uploaded prompt file (the server refuses larger uploads too)
PROMPT_FILE_TYPES = ["txt", "md", "py", "json", "jsonl", "csv"]


def prompt_from_file(name: str, data: bytes) -> str:
    """The text of an uploaded prompt file; ValueError (saying what to do) if too large, not UTF-8, empty."""
    if len(data) > PROMPT_FILE_LIMIT:
        raise ValueError(
            f"{name} has {len(data):,} bytes; prompt files may have at most {PROMPT_FILE_LIMIT:,}"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{name} is not UTF-8 text (byte {exc.start}): save it as UTF-8") from None
    if not text.strip():
        raise ValueError(f"{name} is empty")
    return text


def current_prompt() -> str:
    """The prompt last submitted in this session (the example before any)."""
    return st.session_state.get("prompt", EXAMPLE_PROMPT)


def _upload_key() -> str:
    return f"prompt_file_{st.session_state.setdefault('prompt_file_round', 0)}"


def _keep_prompt() -> None:
    """Submit: the uploaded file's text if a file was given (the uploader is then cleared), else the box."""
    st.session_state.pop("prompt_error", None)
    upload = st.session_state.get(_upload_key())
    if upload is None:
        st.session_state["prompt"] = st.session_state["routing_prompt"]
        return
    try:
        st.session_state["prompt"] = prompt_from_file(upload.name, upload.getvalue())
    except ValueError as exc:
        st.session_state["prompt_error"] = str(exc)
    st.session_state["prompt_file_round"] += 1  # a new key empties the uploader


def prompt_form() -> str:
    """The prompt form, the same on every page: the submitted text is kept in `st.session_state["prompt"]`
    (set by the submit callback, so it survives page switches) and shown again on every page. Long texts
    can come from a file: pasting a 100 kB text into the box stalls the browser for seconds."""
    st.session_state.setdefault("prompt", EXAMPLE_PROMPT)
    st.session_state["routing_prompt"] = st.session_state["prompt"]
    with st.form("prompt_form"):
        st.text_area("Prompt", key="routing_prompt", height=100)
        with st.expander("Or a text file (long inputs)"):
            st.file_uploader(
                f"UTF-8 text, up to {PROMPT_FILE_LIMIT >> 20} MiB; it replaces the prompt on Analyse",
                type=PROMPT_FILE_TYPES,
                key=_upload_key(),
            )
        st.form_submit_button(
            "Analyse", type="primary", help="Or press Ctrl+Enter in the prompt", on_click=_keep_prompt
        )
    if "prompt_error" in st.session_state:
        st.error(st.session_state["prompt_error"])
    return st.session_state["prompt"]


def prompt_or_corpus_trace(source: str) -> moeviz.Trace:
    """A toggle between the prompt (with its form) and the evaluation corpus; the chosen trace."""
    corpus = toggle(
        "Use the evaluation corpus (all domains) instead of the prompt",
        "use_corpus",
        help="8 windows of 256 tokens from each domain of sample_models/eval: enough for the verdicts.",
    )
    if corpus:
        return caches.corpus_trace(source)
    return caches.load_or_stop(source, prompt_form())
