"""How the app presents itself in a lecture hall: the sidebar's "Projector layout" and "Large font" toggles
(kept in `st.session_state`, set up once per run by the entry script), the CSS each adds, the chart heights
the pages read (one small table, a normal and a projector height per chart), and the larger chart fonts.

Projector layout: a 1280 × 720 screen. Less padding around the page, a smaller page title, charts from the
projector column of HEIGHTS, long notices shortened to their first sentence (the rest one click away), and
the pages that read `projector()` lay their controls beside their effect.
Large font: the page's base font size × FONT_SCALE (Streamlit sizes its text in rem) and every chart's
title, axis, legend and text-mark font sizes × FONT_SCALE (`larger_fonts`, applied as a chart is drawn:
its SVG / PNG downloads keep the library's sizes)."""

from __future__ import annotations

import re

import altair as alt
import streamlit as st

from components.widgets import kept

PROJECTOR = "projector_layout"  # st.session_state: the "Projector layout" toggle's value
LARGE_FONT = "large_font"  # st.session_state: the "Large font" toggle's value
FONT_SCALE = 1.25
# chart -> height in px, (normal, projector): the projector column leaves each Learn step on one 1280 × 720
# screen and the Lab's charts on one screen beside its controls
HEIGHTS = {
    "learn_router_row": (22, 13),  # per expert bar of the router walkthrough
    "learn_weights": (170, 120),
    "learn_k_load": (170, 120),
    "learn_load": (190, 150),
    "learn_aux": (190, 140),
    "learn_collapse": (150, 95),
    "learn_bias": (190, 120),
    "learn_shared": (190, 140),
    "learn_finetune": (110, 50),
    "learn_sweep": (260, 140),
    "lab_main": (200, 100),
    "lab_small": (130, 50),
    "lab_snapshot": (130, 50),
    "lab_runs": (150, 90),
    "pg_load": (None, 140),  # None: the chart's own height
}
# The sizes (px) Streamlit's chart theme gives what `larger_fonts` scales when a chart sets none (the
# theme yields to a spec's own config); text marks: Vega-Lite's default
CHART_FONTS = {
    "axis": {"labelFontSize": 12, "titleFontSize": 14},
    "legend": {"labelFontSize": 14, "titleFontSize": 14},
    "header": {"labelFontSize": 12, "titleFontSize": 16},
    "title": {"fontSize": 16, "subtitleFontSize": 11},
    "text": {"fontSize": 11},
}
FONT_KEYS = {"fontSize", "labelFontSize", "titleFontSize", "subtitleFontSize"}
_PROJECTOR_CSS = """
[data-testid='stMainBlockContainer'] { padding: 3rem 1.5rem 1rem 1.5rem; }
[data-testid='stMainBlockContainer'] h1 { font-size: 1.9rem; padding-top: 0; padding-bottom: 0.25rem; }
[data-testid='stMainBlockContainer'] h3 { font-size: 1.35rem; }
[data-testid='stMainBlockContainer'] [data-testid='stMetricValue'] { font-size: 1.6rem; }
[data-testid='stMainBlockContainer'] [data-testid='stVerticalBlock'] { gap: 0.6rem; }
[data-testid='stMainBlockContainer'] [data-testid='stAlertContainer'] { padding: 0.5rem 0.75rem; }
"""
_LARGE_FONT_CSS = f"html {{ font-size: {FONT_SCALE:.0%}; }}"


def setup() -> None:
    """The two toggles at the sidebar's foot and the CSS of those that are on (the entry script calls it on
    every run, before the page)."""
    with st.sidebar:
        kept(
            PROJECTOR,
            [False, True],
            st.toggle,
            "Projector layout",
            help="For a 1280 × 720 projector: each Learn step on one screen, a one-row step selector, the "
            "playground's controls beside their effect, the Lab's charts on one screen.",
        )
        kept(
            LARGE_FONT,
            [False, True],
            st.toggle,
            "Large font",
            help=f"Text and chart labels {FONT_SCALE:.0%} as large, for the back of the room.",
        )
    css = (_PROJECTOR_CSS if projector() else "") + (_LARGE_FONT_CSS if large_font() else "")
    if css:
        st.html(f"<style>{css}</style>")


def projector() -> bool:
    """Whether the projector layout is on."""
    return bool(st.session_state.get(PROJECTOR, False))


def large_font() -> bool:
    """Whether the large font is on."""
    return bool(st.session_state.get(LARGE_FONT, False))


def height(chart: str) -> int | None:
    """The height (px) of `chart` (a HEIGHTS key) in the layout now on."""
    normal, projected = HEIGHTS[chart]
    return projected if projector() else normal


def beside(weights: list[float] | None = None):
    """Two areas: side by side (columns) in the projector layout, else one below the other (containers)
    → (left, right)."""
    if projector():
        return st.columns(weights or [1, 2], gap="medium")
    return st.container(), st.container()


def columns_or_stack(area, spec: int | list[float]) -> list:
    """Columns of `area` (`st.columns` spec), or in the projector layout `area` itself once per column:
    controls in a narrow column beside their effect stack instead of sharing a row."""
    count = spec if isinstance(spec, int) else len(spec)
    return [area] * count if projector() else area.columns(spec)


def first_sentence(text: str) -> tuple[str, str]:
    """`text` split after its first sentence (a full stop followed by a space and a capital or a digit;
    "5.137" and "e.g. x" do not end one) → (first sentence, the rest, possibly "")."""
    parts = re.split(r"(?<=[.!?])\s+(?=[A-Z0-9])", text.strip(), maxsplit=1)
    return parts[0], parts[1] if len(parts) > 1 else ""


def scale_fonts(spec: dict, scale: float = FONT_SCALE) -> dict:
    """`spec` (a Vega-Lite dict) with every font size × `scale`, changed in place: those the chart sets
    (a panel title's, an axis's) and, in its config, Vega-Lite's defaults for the rest. Data is left
    alone."""
    config = spec.setdefault("config", {})
    for part, sizes in CHART_FONTS.items():
        section = config.setdefault(part, {})
        for key, size in sizes.items():
            section.setdefault(key, size)
    stack = [value for key, value in spec.items() if key not in ("datasets", "data")]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            for key, value in node.items():
                if key in FONT_KEYS and isinstance(value, int | float) and not isinstance(value, bool):
                    node[key] = value * scale
                elif key not in ("data", "datasets") and isinstance(value, dict | list):
                    stack.append(value)
    return spec


def larger_fonts(chart: alt.TopLevelMixin) -> alt.TopLevelMixin:
    """With the large font on, have the page's spec of `chart` (its `to_dict`, as `exports.for_the_page`
    set it) come with its fonts scaled (`scale_fonts`); the chart's downloads keep their sizes. In place."""
    if not large_font():
        return chart
    page_spec = chart.to_dict

    def to_dict(*args, **kwargs) -> dict:
        return scale_fonts(page_spec(*args, **kwargs))

    object.__setattr__(chart, "to_dict", to_dict)  # altair keeps attribute writes in the spec otherwise
    return chart
