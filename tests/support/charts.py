"""Helpers shared by the chart spec tests."""

from __future__ import annotations

import altair as alt
import pandas as pd
import pytest

PROMPT = (
    "The for statement is used to iterate over the elements of a sequence (such as a string, tuple or list)."
)


def data_of(spec: dict) -> pd.DataFrame:
    """The rows of a Vega-Lite spec's one inline dataset (shared by its layers)."""
    (values,) = spec["datasets"].values()
    return pd.DataFrame(values)


def count_layer_charts(monkeypatch: pytest.MonkeyPatch) -> list[alt.LayerChart]:
    """Every LayerChart constructed from now on, in order, for the rest of the test (altair constructs a
    layered chart again, deep-copying its layers, on any method called after it)."""
    made: list[alt.LayerChart] = []
    construct = alt.LayerChart.__init__

    def counted(self, *args, **kwargs):
        made.append(self)
        construct(self, *args, **kwargs)

    monkeypatch.setattr(alt.LayerChart, "__init__", counted)
    return made
