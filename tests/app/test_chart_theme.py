"""The page's chart spec in its theme (`components.exports.themed_spec`): on a dark page the library's ink
becomes the dark theme's, on marks and on legend symbols (the weight legend of a token's path at 256
experts was Vega's default blue on the dark background); a light page and the data are left alone."""

from __future__ import annotations

import pytest

from moeviz.analysis import token_scores_frame
from moeviz.charts import INK, token_rank_path_chart
from moeviz.testing.scale_traces import synthetic_trace
from tests.support.app import app_importable


@pytest.fixture
def exports(monkeypatch):
    app_importable(monkeypatch)
    from components import exports

    return exports


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
