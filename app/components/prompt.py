"""The prompt: the same form on every page (typed or from a text file), kept across page switches. The choice
between the prompt, the evaluation corpus and a routing file is `page_input`'s."""

from __future__ import annotations

import streamlit as st

from moeviz.samples import EXAMPLE_PROMPT

# Bytes of an uploaded prompt file: 1 MiB. The server's own limit (`server.maxUploadSize` in
# moeviz.cli.APP_FLAGS) is set above it, so that a larger file reaches the form and is refused here, with
# the reason.
PROMPT_FILE_LIMIT = 1 << 20
PROMPT_FILE_TYPES = ["txt", "md", "py", "json", "jsonl", "csv"]


def prompt_from_file(name: str, data: bytes) -> str:
    """The text of an uploaded prompt file; ValueError (saying what to do) if not of PROMPT_FILE_TYPES,
    too large, not UTF-8, or empty."""
    suffix = name.rpartition(".")[2].lower() if "." in name else ""
    if suffix not in PROMPT_FILE_TYPES:
        kinds = ", ".join(f".{t}" for t in PROMPT_FILE_TYPES)
        raise ValueError(f"{name} is not a text file the form takes ({kinds}): save the text as one of them")
    if len(data) > PROMPT_FILE_LIMIT:
        raise ValueError(
            f"{name} has {len(data):,} bytes; prompt files may have at most {PROMPT_FILE_LIMIT:,} "
            f"({PROMPT_FILE_LIMIT >> 20} MiB)"
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


def submitted_prompt(box: str, upload: tuple[str, bytes] | None, rejected_box: str | None) -> str | None:
    """The prompt an Analyse press submits: the uploaded file's text if a file came (`(name, data)`), else
    the box; ValueError (saying what to do) for a file that is refused. None while an earlier refusal
    stands: no new file came and the box still holds the text it held then (`rejected_box`), so the
    press must not analyse the box as if the file had been taken."""
    if upload is not None:
        return prompt_from_file(*upload)
    if rejected_box is not None and box == rejected_box:
        return None
    return box


def _keep_prompt() -> None:
    """Submit: the uploaded file's text if a file was given (the uploader is then cleared), else the box.
    A refused file leaves its message up, and the prompt unchanged until the input changes."""
    upload = st.session_state.get(_upload_key())
    box = st.session_state["routing_prompt"]
    try:
        text = submitted_prompt(
            box,
            None if upload is None else (upload.name, upload.getvalue()),
            st.session_state.get("prompt_rejected"),
        )
    except ValueError as exc:
        st.session_state["prompt_error"] = str(exc)
        st.session_state["prompt_rejected"] = box
    else:
        if text is not None:
            st.session_state["prompt"] = text
            st.session_state.pop("prompt_error", None)
            st.session_state.pop("prompt_rejected", None)
    if upload is not None:
        st.session_state["prompt_file_round"] += 1  # a new key empties the uploader


def prompt_form() -> str:
    """The prompt form, the same on every page: the submitted text is kept in `st.session_state["prompt"]`
    (set by the submit callback, so it survives page switches) and shown again on every page. Long texts
    can come from a file: pasting a 100 kB text into the box stalls the browser for seconds."""
    st.session_state.setdefault("prompt", EXAMPLE_PROMPT)
    # the box shows the prompt; while a refused file's message stands, the text the box held then
    st.session_state["routing_prompt"] = st.session_state.get("prompt_rejected", st.session_state["prompt"])
    with st.form("prompt_form"):
        st.text_area("Prompt", key="routing_prompt", height=100)
        with st.expander("Or a text file (long inputs)"):
            st.file_uploader(
                f"UTF-8 text ({', '.join('.' + t for t in PROMPT_FILE_TYPES)}), up to "
                f"{PROMPT_FILE_LIMIT >> 20} MiB; it replaces the prompt on Analyse",
                # no `type=`: a file the browser refused would never reach the server, so an Analyse
                # press could not tell it from no file; the type is checked here (`prompt_from_file`)
                key=_upload_key(),
            )
        st.form_submit_button(
            "Analyse", type="primary", help="Or press Ctrl+Enter in the prompt", on_click=_keep_prompt
        )
    if "prompt_error" in st.session_state:
        st.error(st.session_state["prompt_error"])
    return st.session_state["prompt"]
