"""The app's balance numbers are the library's: the Load page on a Switch-style model whose expert capacity
drops slots, opened as a local folder (Streamlit AppTest), shows `balance_frame` and `expert_balance_frame`
of the same trace; the Routing page says how many slots were dropped. The balance vocabulary on every
surface: tests/models/test_balance_surfaces.py and tests/app/test_balance_surfaces_app.py."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from tests.support.app import local_switch_model, run_page

CAPACITY = 5  # tokens per expert and sequence: the example prompt's ~28 tokens overflow 4 experts


@pytest.fixture
def switch_folder(tiny_model_dir, monkeypatch):
    return local_switch_model(tiny_model_dir, monkeypatch, CAPACITY)


def library_trace(folder, text: str):
    import moeviz

    return moeviz.capture(moeviz.load_model(str(folder)), text)


def chart_rows(at: AppTest, title: str) -> pd.DataFrame:
    """The data of the one chart whose spec contains `title` (Streamlit ships it as Arrow)."""
    import pyarrow as pa

    (chart,) = [c for c in at.get("vega_lite_chart") if title in c.proto.spec]
    (dataset,) = chart.proto.datasets
    return pa.ipc.open_stream(dataset.data.data).read_all().to_pandas()


def test_load_page_balance_table_is_the_librarys(switch_folder) -> None:
    from moeviz.analysis import balance_frame, expert_balance_frame

    at = run_page("pages/load.py", timeout_s=120)
    assert at.selectbox(key="model_choice").value == "Local folder…"
    assert at.text_input(key="model_folder").value == str(switch_folder)
    trace = library_trace(switch_folder, at.session_state["prompt"])
    expected = balance_frame(trace)
    assert expected["dropped"].gt(0).any()  # capacity dropped slots: the case under test

    (shown,) = [
        d.value for d in at.dataframe if "gini" in d.value.columns and "verdict" not in d.value.columns
    ]
    shown = shown.reset_index(drop=True)
    assert list(shown.columns) == list(expected.columns)
    assert shown[["site", "layer"]].astype({"layer": int}).equals(expected[["site", "layer"]])
    for column in ("tokens", "experts", "top_k", "dropped", "dead_experts"):
        np.testing.assert_array_equal(shown[column].astype(int), expected[column].astype(int), err_msg=column)
    for column in (
        "dropped_fraction",
        "max_share",
        "min_utilisation",
        "max_utilisation",
        "load_entropy",
        "effective_experts",
        "max_vio",
        "cv",
        "gini",
        "jain",
        "dead_fraction",
    ):
        np.testing.assert_allclose(
            shown[column].astype(float), expected[column].astype(float), rtol=1e-12, err_msg=column
        )

    # the load heatmap's shares and utilisations: of all kT slots, so a layer's shares sum to 1 − dropped
    experts = expert_balance_frame(trace)
    rows = chart_rows(at, "Load per layer and expert").sort_values(["site", "layer", "expert"])
    experts = experts.sort_values(["site", "layer", "expert"])
    np.testing.assert_array_equal(rows["count"].astype(int), experts["count"].astype(int))
    np.testing.assert_allclose(rows["share"], experts["share"], rtol=1e-12)
    np.testing.assert_allclose(rows["utilisation"], experts["utilisation"], rtol=1e-12)
    sums = experts.groupby(["site", "layer"], sort=False)["share"].sum()
    dropped = expected.set_index(["site", "layer"])["dropped_fraction"]
    np.testing.assert_allclose(sums, 1 - dropped.loc[sums.index], rtol=1e-12)
    maxima = experts.groupby(["site", "layer"], sort=False)["share"].max()
    np.testing.assert_allclose(maxima, expected.set_index(["site", "layer"])["max_share"].loc[maxima.index])


def test_routing_page_says_how_many_slots_were_dropped(switch_folder) -> None:
    from moeviz.analysis import balance_frame

    at = run_page("pages/routing.py", timeout_s=120)
    trace = library_trace(switch_folder, at.session_state["prompt"])
    site, layer = trace.layer_keys[0]  # the layer the slider starts on
    row = balance_frame(trace).set_index(["site", "layer"]).loc[(site, layer)]
    assert row["dropped"] > 0
    captions = [c.value for c in at.caption]
    line = next(c for c in captions if c.startswith(f"Layer {layer}:"))
    slots = int(row["tokens"]) * int(row["top_k"])
    assert f"{int(row['dropped']):,} of {slots:,} slots dropped by expert capacity" in line
    assert f"({row['dropped_fraction']:.1%})" in line
