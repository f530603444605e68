"""Charts and tables with their downloads: `show_chart` (SVG/PNG on click), `table_downloads` (CSV and
Parquet on click), the routing table's files, and drawing big views on a canvas."""

from __future__ import annotations

import functools
import io
import tempfile
from collections.abc import Callable
from pathlib import Path

import altair as alt
import pandas as pd
import streamlit as st

import moeviz
from components import presentation
from moeviz.charts import INK, PAPER

CANVAS_ABOVE = 400  # marks; Streamlit itself switches to a canvas only above 2,000 data rows
PARQUET_MIME = "application/vnd.apache.parquet"


def csv_bytes(frame: pd.DataFrame) -> bytes:
    return frame.to_csv(index=False).encode()


def parquet_bytes(frame: pd.DataFrame) -> bytes:
    buffer = io.BytesIO()
    frame.to_parquet(buffer, index=False)
    return buffer.getvalue()


def routing_csv(routing: pd.DataFrame) -> Callable[[], bytes]:
    """Deferred CSV of the routing table (`RoutingFrames.routing`), built only when clicked."""
    return functools.partial(csv_bytes, routing)


def routing_parquet(trace: moeviz.Trace) -> Callable[[], bytes]:
    """Deferred Parquet of the routing table, as a moeviz trace file (adds each row's router logits and
    metadata; `moeviz.Trace.from_parquet` reads it back, pandas reads it as a table)."""

    def build() -> bytes:
        with tempfile.TemporaryDirectory() as tmp:
            return trace.to_parquet(Path(tmp) / "routing.parquet").read_bytes()

    return build


def routing_downloads(trace: moeviz.Trace, routing: pd.DataFrame | None = None) -> None:
    """The routing table as CSV and as a moeviz Parquet trace file, each built only when clicked (a click
    does not rerun the page). Without `routing` (the page's `RoutingFrames.routing`) the CSV's table is
    built from the trace on click: at hundreds of experts and dozens of layers the page never builds it."""
    csv = routing_csv(routing) if routing is not None else lambda: csv_bytes(trace.routing_frame())
    d1, d2 = st.columns(2)
    d1.download_button(
        "Routing table (CSV)", csv, "routing.csv", "text/csv", icon=":material/download:", on_click="ignore"
    )
    d2.download_button(
        "Routing table (Parquet)",
        routing_parquet(trace),
        "routing.parquet",
        PARQUET_MIME,
        icon=":material/download:",
        on_click="ignore",
    )


def table_downloads(frame: pd.DataFrame, name: str) -> None:
    """CSV and Parquet download buttons for one table (files built only when clicked)."""
    formats = (("csv", csv_bytes, "text/csv"), ("parquet", parquet_bytes, PARQUET_MIME))
    for column, (ext, build, mime) in zip(st.columns(2), formats, strict=True):
        file = f"{name}.{ext}"
        column.download_button(
            file,
            functools.partial(build, frame),
            file,
            mime,
            icon=":material/download:",
            on_click="ignore",
            key=f"{ext}_{name}",
        )


def chart_file(chart: alt.TopLevelMixin, fmt: str, title_suffix: str = "") -> bytes:
    """The chart as an SVG or PNG file (vl-convert, no browser), `title_suffix` appended to its title. Any
    number of rows: Altair's default refuses to serialise over 5,000 (a layer × expert heatmap of 61
    layers × 256 experts has 15,616)."""
    import vl_convert

    with alt.data_transformers.enable(max_rows=None):
        spec = type(chart).to_dict(chart, validate=False)  # light, whatever the page's theme
    title = spec.get("title")
    if isinstance(title, str):
        spec["title"] = title + title_suffix
    elif isinstance(title, dict) and isinstance(title.get("text"), str):
        title["text"] += title_suffix
    if "facet" not in spec and "width" not in spec:
        spec["width"] = 900  # the app fits charts to the page; a file needs a width of its own
    if fmt == "svg":
        return vl_convert.vegalite_to_svg(spec).encode()
    return vl_convert.vegalite_to_png(spec, scale=2)


def many_marks(chart: alt.TopLevelMixin, marks: int) -> alt.TopLevelMixin:
    """Have Vega draw a view of more than CANVAS_ABOVE marks on a canvas instead of as SVG: much less work
    in the browser, which redraws these views on every layer switch. Small views stay SVG, their marks
    readable in the page (the browser tests read them). Per-mark work Vega does through its (slow, CSP-safe)
    expression interpreter is turned off: ARIA descriptions (a canvas has no marks to read) and the filter
    of invalid values (these views' values are finite). Set on `chart` itself, which is returned: altair's
    `.properties()` would build a layered chart again, deep-copying each of its layers."""
    if marks <= CANVAS_ABOVE:
        return chart
    chart.usermeta = {"embedOptions": {"renderer": "canvas"}}
    chart.config = alt.Config(aria=False, mark=alt.MarkConfig(invalid=None))
    return chart


# The dark theme's counterparts of the library's two theme colours (Streamlit's dark background is #0e1117).
DARK = {INK: "#f0f2f6", PAPER: "#0e1117"}
# The spec keys whose INK / PAPER values `themed_spec` swaps (marks, and a legend's symbols).
THEMED_KEYS = ("color", "stroke", "fill", "symbolFillColor", "symbolStrokeColor")
# Chart subtitles: Streamlit's chart theme colours titles but leaves subtitles Vega's black.
SUBTITLE = {"light": "#5c5f6b", "dark": "#a3a8b8"}


def themed_spec(spec: dict, theme: str) -> dict:
    """`spec` (a Vega-Lite dict) in the page's theme ("light" or "dark"), changed in place: subtitles in
    the theme's secondary text colour and, on the dark theme, the library's INK outlines and PAPER cell
    separators swapped for their dark counterparts. Data is left alone."""
    config = spec.setdefault("config", {})
    config.setdefault("title", {}).setdefault("subtitleColor", SUBTITLE.get(theme, SUBTITLE["light"]))
    if theme != "dark":
        return spec
    stack = [value for key, value in spec.items() if key != "datasets"]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            for key, value in node.items():
                if key in THEMED_KEYS and isinstance(value, str) and value in DARK:
                    node[key] = DARK[value]
                elif key != "data" and isinstance(value, dict | list):
                    stack.append(value)
    return spec


def for_the_page(chart: alt.TopLevelMixin) -> None:
    """Make Streamlit's `chart.to_dict()` skip the JSON-schema check (about a quarter of a page rerun, ~15
    ms a chart; every chart function's spec is already validated by the chart tests) and return the spec
    in the page's theme (`themed_spec`). The chart itself is unchanged: its downloads stay light."""
    theme = st.context.theme.type or "light"

    def to_dict(*args, **kwargs) -> dict:
        kwargs.setdefault("validate", False)
        return themed_spec(type(chart).to_dict(chart, *args, **kwargs), theme)

    # altair keeps attribute writes in the spec (`SchemaBase.__setattr__`): set the instance attribute.
    object.__setattr__(chart, "to_dict", to_dict)


def keep_labels(chart: alt.TopLevelMixin) -> alt.TopLevelMixin:
    """Turn off Vega's label overlap removal on every x/y axis that does not choose (in place): Vega-Lite's
    default hides every other label of an ordinal axis as soon as two touch (61 layers, hundreds of
    experts), so a category would silently lose its label. Axes that ask for it (a 200-token window's
    token axis) keep it; where labels never touch (the 8-expert samples) nothing changes."""
    stack = [chart]
    while stack:
        node = stack.pop()
        kwds = getattr(node, "_kwds", None)
        if kwds is None:
            continue
        for name in ("layer", "vconcat", "hconcat", "concat"):
            parts = kwds.get(name, alt.Undefined)
            if isinstance(parts, list):
                stack.extend(parts)
        if kwds.get("spec", alt.Undefined) is not alt.Undefined:
            stack.append(kwds["spec"])
        encoding = kwds.get("encoding", alt.Undefined)
        if encoding is alt.Undefined or not hasattr(encoding, "_kwds"):
            continue
        for channel in ("x", "y"):
            position = encoding._kwds.get(channel, alt.Undefined)
            if not hasattr(position, "_kwds"):
                continue
            axis = position._kwds.get("axis", alt.Undefined)
            if axis is alt.Undefined:
                position["axis"] = alt.Axis(labelOverlap=False)
            elif hasattr(axis, "_kwds") and axis._kwds.get("labelOverlap", alt.Undefined) is alt.Undefined:
                axis["labelOverlap"] = False
    return chart


def show_chart(chart: alt.TopLevelMixin, key: str, *, select: bool = False, file_title_suffix: str = ""):
    """Render a chart in a container keyed `key`, with SVG and PNG downloads below it (built on click).
    With `select`, the page reruns on a selection and the selection event is returned. Every label of
    its axes is kept (`keep_labels`). `file_title_suffix` is appended to the title of the saved files
    only: what the page shows beside the chart (its layer), left out of the chart itself so that its spec
    stays the same from layer to layer (the browser then swaps the data into the drawn chart)."""
    keep_labels(chart)
    for_the_page(chart)
    presentation.larger_fonts(chart)
    with st.container(key=key):
        # a concatenation (the layer × expert overview + detail) keeps its own width: stretched, Streamlit
        # sets each part to the column's width, and the axis beside it pushed the last expert label off
        width = "content" if isinstance(chart, alt.VConcatChart) else "stretch"
        event = st.altair_chart(
            chart, width=width, on_select="rerun" if select else "ignore", key=f"{key}_chart"
        )
    if presentation.projector():  # a projector's screen has no line to spare (the chart's menu saves a PNG)
        return event
    with st.popover("Save chart", icon=":material/image:"):
        for fmt, mime in (("svg", "image/svg+xml"), ("png", "image/png")):
            st.download_button(
                fmt.upper(),
                functools.partial(chart_file, chart, fmt, file_title_suffix),
                f"{key}.{fmt}",
                mime,
                on_click="ignore",
                key=f"{key}_{fmt}",
            )
    return event
