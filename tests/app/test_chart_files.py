"""A chart as the app ships it (`components.exports`). Its saved SVG and PNG (`chart_file`): the title suffix
that a per-layer chart leaves off the page (Routing names the layer beside its charts) is in the file, on a
plain title and on a title with a subtitle; the page's own chart spec is left alone. Its page spec in the
page's theme (`themed_spec`): on a dark page the library's ink becomes the dark theme's, on marks and on
legend symbols (the weight legend of a token's path at 256 experts was Vega's default blue on the dark
background); a light page and the data are left alone. The canvas switch (`many_marks`) sets its
properties in place: altair's `.properties()` constructs a layered chart again, deep-copying its layers."""

from __future__ import annotations

import altair as alt
import pandas as pd
import pytest

from moeviz.analysis import token_scores_frame
from moeviz.charts import INK, token_rank_path_chart
from moeviz.testing.scale_traces import synthetic_trace
from tests.support.app import app_importable
from tests.support.charts import count_layer_charts


@pytest.fixture
def exports(monkeypatch):
    app_importable(monkeypatch)
    from components import exports

    return exports


def chart(title) -> alt.Chart:
    return (
        alt.Chart(pd.DataFrame({"x": [0, 1], "y": [1, 2]}), title=title).mark_bar().encode(x="x:O", y="y:Q")
    )


@pytest.mark.parametrize(
    "title",
    ["Router scores", alt.Title("Router scores", subtitle="28 tokens")],
    ids=["plain", "with subtitle"],
)
def test_the_saved_file_names_what_the_page_says_beside_the_chart(exports, title):
    shown = chart(title)
    page_spec = shown.to_dict()
    svg = exports.chart_file(shown, "svg", ", layer 2").decode()
    assert "Router scores, layer 2" in svg
    assert "Router scores, layer 2" not in exports.chart_file(shown, "svg").decode()  # no suffix: as shown
    assert shown.to_dict() == page_spec  # the chart on the page keeps its layer-free title
    if isinstance(title, alt.Title):
        assert "28 tokens" in svg


def weight_legend(spec: dict) -> dict:
    (size,) = [layer["encoding"]["size"] for layer in spec["layer"] if "size" in layer.get("encoding", {})]
    return size["legend"]


@pytest.mark.parametrize("theme", ["light", "dark"])
def test_the_paths_weight_legend_is_drawn_in_the_pages_ink(exports, theme):
    mine = token_scores_frame(synthetic_trace(num_tokens=40), 0, 3)
    spec = token_rank_path_chart(mine).to_dict(validate=False)
    assert weight_legend(spec)["symbolFillColor"] == INK
    themed = exports.themed_spec(spec, theme)
    ink = exports.DARK[INK] if theme == "dark" else INK
    assert weight_legend(themed)["symbolFillColor"] == ink
    assert ink != "#4c78a8"


def test_only_the_librarys_colours_are_swapped_and_never_in_the_data(exports):
    spec = {
        "mark": {"type": "rect", "stroke": INK, "fill": "#4c78a8"},
        "encoding": {"color": {"legend": {"symbolStrokeColor": INK, "labelColor": INK}}},
        "datasets": {"d": [{"colour": INK, "fill": INK}]},
    }
    themed = exports.themed_spec(spec, "dark")
    assert themed["mark"] == {"type": "rect", "stroke": exports.DARK[INK], "fill": "#4c78a8"}
    assert themed["encoding"]["color"]["legend"] == {
        "symbolStrokeColor": exports.DARK[INK],
        "labelColor": INK,
    }
    assert themed["datasets"] == {"d": [{"colour": INK, "fill": INK}]}


def test_the_canvas_switch_sets_its_properties_in_place(exports, monkeypatch):
    made = count_layer_charts(monkeypatch)
    layered = alt.layer(chart("Expert load").mark_line(), chart("Expert load").mark_point())
    before = len(made)
    on_canvas = exports.many_marks(layered, exports.CANVAS_ABOVE + 1)
    assert on_canvas is layered and len(made) == before
    spec = on_canvas.to_dict(validate=False)
    assert spec["usermeta"] == {"embedOptions": {"renderer": "canvas"}}
    assert spec["config"]["aria"] is False
