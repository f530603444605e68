"""Library errors in a page: shown as a message (never a traceback), and the page stops."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import streamlit as st

import moeviz


@contextlib.contextmanager
def stop_on_error() -> Iterator[None]:
    """Show a library error raised inside as a message and stop the page."""
    try:
        yield
    except moeviz.MoevizError as exc:
        st.error(str(exc))
        st.stop()
