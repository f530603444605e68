"""The Learn page's building blocks: the fixed lesson text and samples, the step picker (kept across page
switches, with previous / next buttons), links to pages that may not be registered yet, and the experts
sweep table when it is shipped."""

from __future__ import annotations

import numpy as np
import pandas as pd
import streamlit as st
from streamlit.errors import StreamlitAPIException

import moeviz
from components.docs import EXPERTS_SWEEP
from components.widgets import kept

# A short text from the bundled held-out slices (sample_models/eval), one piece of each of the samples'
# five training domains, so that the routing moves between experts along it. Fixed: every number of the
# lesson is measured on it.
LESSON_TEXT = (
    "At the end of two full years, Pharaoh dreamed, and behold, he stood by the river.\n"
    "Y aconteció que pasados dos años tuvo Faraón un sueño.\n"
    "def mean(values):\n"
    "    return sum(values) / len(values)\n"
    "371 / 7 = 53\n"
    "82 * 48 = 3936\n"
    "The for statement is used to iterate over the elements of a sequence."
)
HEALTHY = "sample:mixtral-healthy"
COLLAPSE_SAMPLES = {
    "healthy": "sample:mixtral-healthy",
    "unbalanced": "sample:mixtral-unbalanced",
    "collapsed": "sample:mixtral-collapsed",
}
BIASED = "sample:deepseek-v3-bias"
SWEEP = EXPERTS_SWEEP  # written by scripts/experts_sweep.py
STEP_KEY = "learn_step"


def experts_sweep() -> pd.DataFrame | None:
    """The shipped experts sweep (docs/experts-sweep.csv: columns experts, k, heldout_loss, …), or None
    while it is not there (the lesson then leaves its step out)."""
    if not SWEEP.is_file():
        return None
    table = pd.read_csv(SWEEP)
    return table if {"experts", "k", "heldout_loss"} <= set(table.columns) and len(table) else None


def _go(steps: list[str], delta: int) -> None:
    """Button callback: move the kept step by `delta` (clamped to the first and last)."""
    current = st.session_state.get(STEP_KEY, steps[0])
    index = steps.index(current) if current in steps else 0
    st.session_state[STEP_KEY] = steps[min(max(index + delta, 0), len(steps) - 1)]


def step_picker(steps: dict[str, str]) -> str:
    """The lesson's steps (key → short label) as a segmented control between previous / next buttons, on one
    row; the step survives page switches (`st.session_state["learn_step"]`). → the chosen step's key."""
    keys = list(steps)
    with st.container(horizontal=True, vertical_alignment="center", gap="small", key="learn_steps"):
        st.button(
            ":material/chevron_left:", key="learn_prev", on_click=_go, args=(keys, -1), help="Previous step"
        )
        step = kept(
            STEP_KEY,
            keys,
            st.segmented_control,
            "Step",
            keys,
            format_func=steps.get,
            required=True,
            label_visibility="collapsed",
        )
        st.button(
            ":material/chevron_right:", key="learn_next", on_click=_go, args=(keys, 1), help="Next step"
        )
    return step


def step_heading(title: str):
    """The step's heading on the left of a row whose right part (returned) holds its one control: one line
    of the screen instead of two, so that a step fits a 1280 × 720 projector."""
    left, right = st.columns([3, 2], vertical_alignment="bottom")
    left.subheader(title)
    return right


def compact_top() -> None:
    """Less empty space above the title on this page (Streamlit's default top padding is ~6rem): the lesson's
    screens are sized for a 720-pixel-high projector."""
    st.html("<style>[data-testid='stMainBlockContainer'] { padding-top: 2.5rem; }</style>")


def page_link_if_registered(page: str, label: str, icon: str) -> bool:
    """A link to `page` if the app's navigation has it (pages being written may not be registered yet);
    → whether it was drawn."""
    try:
        st.page_link(page, label=label, icon=icon)
    except StreamlitAPIException:
        return False
    return True


def layer_row(trace: moeviz.Trace, site: str, layer: int, seq: int, pos: int) -> int:
    """The row of token (seq, pos) among the tokens layer (site, layer) routed."""
    tokens = trace.tokens
    wanted = np.flatnonzero((tokens["seq"].to_numpy() == seq) & (tokens["pos"].to_numpy() == pos))
    rows = np.flatnonzero(np.isin(trace.layer(layer, site).token_rows, wanted))
    if not len(rows):
        raise KeyError(f"layer {layer} did not route token {seq}/{pos}")
    return int(rows[0])
