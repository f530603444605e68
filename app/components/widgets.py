"""Widgets whose value survives page switches: Streamlit drops a widget's state when its page is left, so
each value is also kept under a store key of its own in `st.session_state`."""

from __future__ import annotations

from collections.abc import Callable

import streamlit as st


def remember(widget_key: str, store_key: str, options: list) -> None:
    """Give widget `widget_key` the value kept under `store_key` (or the first option when that value is
    not offered). Call before the widget, which must pass `on_change=keep, args=(widget_key, store_key)`
    (`kept` does both): widget state does not survive a page switch, the store does."""
    value = st.session_state.get(store_key)
    st.session_state[store_key] = value if value in options else options[0]
    st.session_state[widget_key] = st.session_state[store_key]


def keep(widget_key: str, store_key: str) -> None:
    """Widget callback: copy the widget's new value to its store (see `remember`)."""
    st.session_state[store_key] = st.session_state[widget_key]


def kept(
    store_key: str, options, widget: Callable, *widget_args, widget_key: str | None = None, **widget_kwargs
):
    """Draw `widget(*widget_args, **widget_kwargs)` keyed `widget_key` (default `<store_key>_widget`) with
    the value kept under `store_key` (see `remember`): a choice that survives page switches. → that value."""
    widget_key = widget_key or f"{store_key}_widget"
    remember(widget_key, store_key, options)
    widget(*widget_args, key=widget_key, on_change=keep, args=(widget_key, store_key), **widget_kwargs)
    return st.session_state[store_key]


def toggle(label: str, store_key: str, help: str | None = None) -> bool:
    """A toggle whose value survives page switches (`st.session_state[store_key]`)."""
    return bool(kept(store_key, [False, True], st.toggle, label, help=help))


def number(label: str, store_key: str, default: int, lo: int, hi: int, help: str | None = None) -> int:
    """An integer input whose value survives page switches (`st.session_state[store_key]`)."""
    # a kept value out of [lo, hi] is clamped (not reset to lo, as `remember` would)
    st.session_state[store_key] = min(max(int(st.session_state.get(store_key, default)), lo), hi)
    return int(kept(store_key, range(lo, hi + 1), st.number_input, label, lo, hi, step=1, help=help))


def new_click(clicked, seen_key: str) -> bool:
    """Whether `clicked` (a chart selection, or None) differs from the one seen on the last run: a chart
    keeps reporting its selection on every rerun, but only a new click should move a picker."""
    new = clicked is not None and clicked != st.session_state.get(seen_key)
    st.session_state[seen_key] = clicked
    return new
