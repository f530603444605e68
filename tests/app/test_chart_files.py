"""A chart's saved SVG and PNG (`components.exports.chart_file`): the title suffix that a per-layer chart
leaves off the page (Routing names the layer beside its charts) is in the file, on a plain title and on a
title with a subtitle; the page's own chart spec is left alone."""

from __future__ import annotations

import altair as alt
import pandas as pd
import pytest

from tests.support.app import app_importable


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
