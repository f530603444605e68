"""The Learn page's building blocks: the fixed lesson text and samples, the user's own text in its place
("Use my own text"), the step picker (kept across page switches, with previous / next buttons), links to
pages that may not be registered yet, the experts sweep table when it is shipped, and each step's notice
and caption (shortened on a projector, `components.presentation`)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import streamlit as st
from streamlit.errors import StreamlitAPIException

import moeviz
from components import presentation
from components.docs import EXPERTS_SWEEP
from components.widgets import keep, kept, toggle

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
OWN_TEXT_ON = "learn_use_own_text"  # kept: "Use my own text" is on
OWN_TEXT = "learn_own_text"  # kept: the user's text
TEXT_SEEN = "learn_text_seen"  # the text the last run routed
# characters of the user's text: one forward through each sample, a second or two on a CPU (the lesson's
# own text is ~350); longer inputs belong on the Routing page
MAX_OWN_TEXT = 3000


def lesson_text(controls) -> str | None:
    """The "Use my own text" toggle and, when on, a text area for the user's text (at most MAX_OWN_TEXT
    characters, kept across page switches), drawn in `controls` (the sidebar: the step keeps its screen);
    → the text the routing steps read: LESSON_TEXT, the user's, or None after a message (in the main
    area) saying what to do when the user's is empty."""
    with controls:
        return _chosen_text()


def _chosen_text() -> str | None:
    if not toggle(
        "Use my own text",
        OWN_TEXT_ON,
        help="Route a text of yours through the samples instead of the lesson's: the steps' numbers and "
        "what-to-notice lines are then those of your text.",
    ):
        return LESSON_TEXT
    widget_key = f"{OWN_TEXT}_widget"
    st.session_state.setdefault(OWN_TEXT, "")
    st.session_state[widget_key] = st.session_state[OWN_TEXT]
    st.text_area(
        f"Your text (up to {MAX_OWN_TEXT:,} characters)",
        key=widget_key,
        max_chars=MAX_OWN_TEXT,
        height=90,
        placeholder="Paste a paragraph, some code or a few sums…",
        on_change=keep,
        args=(widget_key, OWN_TEXT),
    )
    text = str(st.session_state[OWN_TEXT])[:MAX_OWN_TEXT]
    if not text.strip():
        st.caption("Your text is empty.")
        return None
    return text


def forget_choices_on_new_text(text: str, keys: list[str]) -> None:
    """When the routed text changed since the last run (the user's text typed or toggled), drop the kept
    choices `keys` (each step's layer): each step reopens where its point shows most on the new text."""
    seen = st.session_state.get(TEXT_SEEN)
    if seen is not None and seen != text:
        for key in keys:
            st.session_state.pop(key, None)
    st.session_state[TEXT_SEEN] = text


def empty_text_message() -> None:
    """What the routing steps show in place of their numbers while the user's text is empty."""
    st.info(
        "**Your text is empty.** Type or paste one in the sidebar's text box (then Ctrl+Enter), or turn off "
        "**Use my own text** to follow the lesson on its own text.",
        icon=":material/edit_note:",
    )


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
    row when the labels fit (in the projector layout they do at 900 px too: the steps' numbers only, the
    heading below names the step); the step survives page switches (`st.session_state["learn_step"]`).
    → the chosen step's key."""
    keys = list(steps)
    label = (lambda key: steps[key].split(" ", 1)[0]) if presentation.projector() else steps.get
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
            format_func=label,
            required=True,
            label_visibility="collapsed",
            width="content",  # stretched, it took the row and pushed the next button onto a row of its own
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
    screens are sized for a 720-pixel-high projector (whose layout sets its own, `presentation`)."""
    if not presentation.projector():
        st.html("<style>[data-testid='stMainBlockContainer'] { padding-top: 2.5rem; }</style>")


def notice(text: str) -> None:
    """The step's one "what to notice" line; in the projector layout its first sentence, the rest behind a
    "More" button beside it (a five-line notice would push the chart off a 720-pixel screen)."""
    icon = ":material/visibility:"
    first, rest = presentation.first_sentence(text) if presentation.projector() else (text, "")
    if not rest:
        st.info(f"**What to notice:** {text}", icon=icon)
        return
    box, more = st.columns([5, 1], vertical_alignment="center", gap="small")
    box.info(f"**What to notice:** {first} …", icon=icon)
    with more.popover("More", width="stretch"):
        st.markdown(text)


def details(text: str) -> None:
    """A step's explanatory caption; in the projector layout behind a "Details" expander (the chart and
    its notice come first on a 720-pixel screen)."""
    if presentation.projector():
        with st.expander("Details"):
            st.caption(text)
    else:
        st.caption(text)


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
