"""The Routing page's interactions at scale (Streamlit AppTest, a synthetic DeepSeek-V3-shaped trace): a
sort of the expert axis, or a picked expert, changes the heatmaps' data alone, never their spec, so the
browser patches the new rows into the drawn charts (Streamlit keeps a Vega view whose spec, dataset names
aside, is unchanged) instead of compiling and drawing new ones; and the order the data carries is the
library's expert order, computed here apart from the app."""

from __future__ import annotations

import io
import json

import pandas as pd
import pyarrow as pa
import pytest

from moeviz.analysis import expert_balance_frame, layer_trace
from moeviz.analysis.expert_order import expert_order
from moeviz.charts.scale import ORDER_FIELD
from moeviz.testing.scale_traces import shaped_trace
from tests.support.app import app_test_env, captured_as, run_page

PROMPT = "synthetic deepseek_v3 trace, routing interactions"
TOP_N = 32  # the expert axis's default top-N
HEATMAPS = ("Router scores", "Dispatch over the whole input")
PER_LAYER = (*HEATMAPS, "Tokens by top-1 expert", "Expert load")  # the charts a layer switch redraws


@pytest.fixture(scope="module")
def trace():
    return shaped_trace("deepseek_v3", num_tokens=256)  # over the 64-token window: the binned overview too


@pytest.fixture
def viewed(trace, monkeypatch):
    """The app's capture of PROMPT is the synthetic trace (the sample stays the model)."""
    app_test_env(monkeypatch)
    captured_as(monkeypatch, PROMPT, trace)
    return trace


def _named_datasets_aside(node):
    """A spec with every dataset reference by name replaced by a placeholder (Streamlit names each dataset
    by a hash of its rows and compares specs without those names)."""
    if isinstance(node, dict):
        return {
            key: "<dataset>"
            if key == "data" and isinstance(value, dict) and "name" in value
            else _named_datasets_aside(value)
            for key, value in node.items()
            if key != "datasets"
        }
    if isinstance(node, list):
        return [_named_datasets_aside(value) for value in node]
    return node


def heatmaps(at, titles: tuple[str, ...] = HEATMAPS) -> dict[str, tuple[dict, pd.DataFrame]]:
    """The page's charts of `titles` (default its two heatmaps) by title: (spec without dataset names, its
    rows)."""
    out = {}
    for chart in at.get("arrow_vega_lite_chart") + at.get("vega_lite_chart"):
        for title in titles:
            if f'"text": "{title}' in chart.proto.spec:
                (dataset,) = chart.proto.datasets
                rows = pa.ipc.open_stream(io.BytesIO(dataset.data.data)).read_all().to_pandas()
                out[title] = (_named_datasets_aside(json.loads(chart.proto.spec)), rows)
    assert set(out) == set(titles), list(out)
    return out


def experts_in_order(rows: pd.DataFrame) -> list[int]:
    """The experts of a heatmap's rows in the order its data gives them."""
    ranked = rows.groupby("expert")[ORDER_FIELD].min().sort_values(kind="stable")
    return [int(e) for e in ranked.index]


def test_sort_and_pick_change_only_the_heatmaps_data(viewed) -> None:
    trace = viewed
    at = run_page("pages/routing.py", timeout_s=300, model="sample:mixtral-healthy", prompt=PROMPT)
    first = trace.layers[0]
    load = expert_balance_frame(layer_trace(trace, first.layer))
    busiest = [int(e) for e in expert_order(load, by="load")[:TOP_N]]  # the chosen expert is the busiest
    before = heatmaps(at)
    for _, rows in before.values():
        assert experts_in_order(rows) == sorted(busiest)  # by id

    at.selectbox(key="expert_sort_widget").set_value("load").run()
    assert not at.exception, [e.value for e in at.exception]
    after = heatmaps(at)
    for title in HEATMAPS:
        assert after[title][0] == before[title][0], title  # the same spec: the browser keeps its chart
        assert experts_in_order(after[title][1]) == busiest  # busiest first

    quiet = int(expert_order(load, by="load")[-1])  # the least loaded: outside the top-N
    at.selectbox(key="expert_widget").set_value(quiet).run()
    assert not at.exception, [e.value for e in at.exception]
    picked = heatmaps(at)
    # the chosen expert joins the axis at its place by load (last); the rows' spec is that of 33 experts
    for title in HEATMAPS:
        assert experts_in_order(picked[title][1]) == [*busiest, quiet]
        assert picked[title][0] == after[title][0], title  # one row more: the data's, not the spec's


def test_a_layer_switch_and_a_pick_change_only_the_per_layer_charts_data(viewed) -> None:
    trace = viewed
    at = run_page("pages/routing.py", timeout_s=300, model="sample:mixtral-healthy", prompt=PROMPT)
    before = heatmaps(at, PER_LAYER)
    at.select_slider(key="layer_widget").set_value(at.select_slider(key="layer_widget").options[1]).run()
    assert not at.exception, [e.value for e in at.exception]
    after = heatmaps(at, PER_LAYER)
    second = trace.layers[1]
    load = expert_balance_frame(layer_trace(trace, second.layer))
    busiest = [int(e) for e in expert_order(load, by="load")[:TOP_N]]
    assert experts_in_order(after["Router scores"][1]) == sorted(busiest)  # the new layer's rows arrived
    for title in PER_LAYER:  # the same spec: the browser keeps each drawn chart
        assert after[title][0] == before[title][0], title
    quiet = int(expert_order(load, by="load")[-1])
    at.selectbox(key="expert_widget").set_value(quiet).run()
    assert not at.exception, [e.value for e in at.exception]
    picked = heatmaps(at, PER_LAYER)
    for title in PER_LAYER:
        assert picked[title][0] == after[title][0], title
    # the strip and the curve outline the chosen expert through their data
    strip, curve = picked["Tokens by top-1 expert"][1], picked["Expert load"][1]
    assert curve.loc[curve["chosen"], "expert"].tolist() == [quiet]
    assert (strip["chosen"] == (strip["expert"] == quiet)).all()


def spec_titled(at, title: str) -> dict:
    """The spec of the page's one chart whose title starts with `title`."""
    specs = [
        json.loads(chart.proto.spec)
        for chart in at.get("arrow_vega_lite_chart") + at.get("vega_lite_chart")
        if f'"text": "{title}' in chart.proto.spec
    ]
    assert len(specs) == 1, (title, len(specs))
    return specs[0]


def test_the_views_at_scale_leave_the_browser_no_per_mark_text(viewed) -> None:
    at = run_page("pages/routing.py", timeout_s=300, model="sample:mixtral-healthy", prompt=PROMPT)
    load = spec_titled(at, "Expert load")  # a point per expert, redrawn on every layer switch
    assert load["usermeta"]["embedOptions"]["renderer"] == "canvas"
    assert load["config"]["aria"] is False
    assert load["config"]["mark"]["invalid"] is None
    at.toggle(key="scale_token_detail_widget").set_value(True).run()  # the token's drill-down
    assert not at.exception, [e.value for e in at.exception]
    path = spec_titled(at, "Path of")  # layers × ranks cells
    assert path["usermeta"]["embedOptions"]["renderer"] == "canvas"
    assert path["config"]["aria"] is False


def test_a_sort_and_a_sort_back_reuse_the_charts_already_built(viewed, monkeypatch) -> None:
    """The per-layer charts are built once per input (`ChartMemo`): a sort leaves the token strip's inputs
    alone, and a sort back finds the heatmaps of that order built; what is shown is what a build shows."""
    import moeviz.charts

    built = {"token_strip_chart": 0, "router_score_heatmap": 0}
    for name in built:
        real = getattr(moeviz.charts, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            built[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(moeviz.charts, name, counted)  # the page imports them on each run
    at = run_page("pages/routing.py", timeout_s=300, model="sample:mixtral-healthy", prompt=PROMPT)
    first = heatmaps(at, PER_LAYER)
    assert built == {"token_strip_chart": 1, "router_score_heatmap": 1}
    at.selectbox(key="expert_sort_widget").set_value("load").run()
    assert not at.exception, [e.value for e in at.exception]
    assert built == {"token_strip_chart": 1, "router_score_heatmap": 2}  # a new order: a new heatmap alone
    at.selectbox(key="expert_sort_widget").set_value("id").run()
    assert not at.exception, [e.value for e in at.exception]
    assert built == {"token_strip_chart": 1, "router_score_heatmap": 2}  # the order of the first run
    again = heatmaps(at, PER_LAYER)
    for title in PER_LAYER:  # the same spec and the same rows as when built
        assert again[title][0] == first[title][0], title
        pd.testing.assert_frame_equal(again[title][1], first[title][1])
