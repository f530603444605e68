"""Helpers shared by the chart spec tests."""

from __future__ import annotations

import pandas as pd

PROMPT = (
    "The for statement is used to iterate over the elements of a sequence (such as a string, tuple or list)."
)


def data_of(spec: dict) -> pd.DataFrame:
    """The rows of a Vega-Lite spec's one inline dataset (shared by its layers)."""
    (values,) = spec["datasets"].values()
    return pd.DataFrame(values)
