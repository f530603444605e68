"""The sidebar's "Projector layout" and "Large font" toggles (Streamlit AppTest): each changes what the pages
render (the step selector's labels, the charts' heights and font sizes, where the playground's controls
sit), and stays set on the next page. Chart specs are read as the browser gets them (`proto.spec`)."""

from __future__ import annotations

import json

import pytest
from streamlit.testing.v1 import AppTest

from tests.support.app import app_importable, run_page
from tests.support.learn import PAGE, _app_env  # noqa: F401  (fixture: pytest finds it in the module)

FONT_KEYS = {"fontSize", "labelFontSize", "titleFontSize", "subtitleFontSize"}


@pytest.fixture(scope="module")
def presentation():
    """`components.presentation`, imported as the pages import it."""
    with pytest.MonkeyPatch.context() as mp:
        app_importable(mp)
        from components import presentation

        return presentation


def spec_of(at: AppTest, title: str) -> dict:
    """The spec of the one chart whose spec contains `title`."""
    specs = [json.loads(chart.proto.spec) for chart in at.get("vega_lite_chart")]
    (spec,) = [spec for spec in specs if title in json.dumps(spec, ensure_ascii=False)]
    return spec


def toggles_page() -> None:
    """The entry script's part (`presentation.setup`) and one chart drawn as the pages draw theirs
    (AppTest runs a page's file alone, without the entry script)."""
    import altair as alt
    import pandas as pd
    from components import exports, presentation

    presentation.setup()
    frame = pd.DataFrame({"expert": [0, 1], "count": [3, 5]})
    chart = alt.Chart(frame).mark_bar().encode(x="expert:O", y="count:Q")
    exports.show_chart(chart.properties(title="probe", height=presentation.height("learn_load")), "probe")


def switch(at: AppTest, key: str, on: bool = True) -> AppTest:
    at.sidebar.toggle(key=f"{key}_widget").set_value(on).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def font_sizes(node, path: str = "") -> dict[str, float]:
    """Every font size in a spec (data left out), by its path."""
    found = {}
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("data", "datasets"):
                continue
            if key in FONT_KEYS and isinstance(value, int | float):
                found[f"{path}/{key}"] = value
            else:
                found.update(font_sizes(value, f"{path}/{key}"))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found.update(font_sizes(value, f"{path}/{i}"))
    return found


def test_the_sidebar_toggles_restyle_the_page_and_its_charts(presentation) -> None:
    at = AppTest.from_function(toggles_page, default_timeout=30).run()
    assert not at.exception, [e.value for e in at.exception]
    normal = json.loads(at.get("vega_lite_chart")[0].proto.spec)
    assert normal["height"] == presentation.HEIGHTS["learn_load"][0]
    assert [p for p in at.get("popover") if "Save chart" in str(p.proto)]
    assert not at.get("html")  # no CSS while both are off

    switch(at, presentation.PROJECTOR)
    assert at.session_state[presentation.PROJECTOR] is True
    projected = json.loads(at.get("vega_lite_chart")[0].proto.spec)
    assert projected["height"] == presentation.HEIGHTS["learn_load"][1] < normal["height"]
    assert not [p for p in at.get("popover") if "Save chart" in str(p.proto)]  # no line to spare
    (css,) = [h.proto.body for h in at.get("html")]
    assert "padding" in css and "font-size: 125%" not in css

    switch(at, presentation.LARGE_FONT)
    large = json.loads(at.get("vega_lite_chart")[0].proto.spec)
    for part, sizes in presentation.CHART_FONTS.items():  # Streamlit's theme sizes, × 1.25 in the config
        for key, size in sizes.items():
            assert large["config"][part][key] == pytest.approx(size * presentation.FONT_SCALE)
    (css,) = [h.proto.body for h in at.get("html")]
    assert "font-size: 125%" in css

    switch(at, presentation.PROJECTOR, on=False)
    assert json.loads(at.get("vega_lite_chart")[0].proto.spec)["height"] == normal["height"]


def test_projector_layout_numbers_the_steps_and_shrinks_the_charts(presentation) -> None:
    at = run_page(PAGE, learn_step="load")
    assert "3 Load" in at.segmented_control(key="learn_step_widget").options  # named steps
    normal = spec_of(at, "Expert load, MoE layer")["height"]

    at = run_page(PAGE, learn_step="load", **{presentation.PROJECTOR: True})
    steps = at.segmented_control(key="learn_step_widget")
    # the step numbers alone (one row at 900 px), in the lesson's order; the heading names the step
    assert steps.options[:8] == [str(n) for n in range(1, 9)]
    assert at.subheader[0].value.startswith("3 ·")
    projected = spec_of(at, "Expert load, MoE layer")["height"]
    assert (normal, projected) == presentation.HEIGHTS["learn_load"] and projected < normal
    assert [e for e in at.expander if e.label == "Details"]  # the caption one click away
    # kept on the next page: the playground's controls stack in one column beside their effect
    at.switch_page("pages/playground.py").run()
    assert not at.exception
    (controls,) = [column for column in at.columns if any(s.key == "pg_k" for s in column.slider)]
    assert {s.key for s in controls.slider} >= {"pg_k", "pg_temperature"}
    assert [b.key for b in controls.button] == ["pg_reset"]
    (effect,) = [c for c in at.columns if any(m.label == "Tokens that changed experts" for m in c.metric)]
    assert effect is not controls


def test_playground_controls_share_a_row_without_the_projector_layout() -> None:
    at = run_page("pages/playground.py")
    holding = [c for c in at.columns if any(s.key in ("pg_k", "pg_temperature") for s in c.slider)]
    assert len(holding) == 2  # k and temperature side by side, each in its own column
    assert not [c for c in at.columns if any(m.label == "Tokens that changed experts" for m in c.metric)]


def test_large_font_scales_every_font_of_a_learn_chart(presentation) -> None:
    normal = font_sizes(spec_of(run_page(PAGE, learn_step="router"), "Token 0:"))
    at = run_page(PAGE, learn_step="router", **{presentation.LARGE_FONT: True})
    large = font_sizes(spec_of(at, "Token 0:"))
    # every size the chart sets (panel titles, axis labels) and every theme size in its config, × 1.25
    assert normal and set(normal) < set(large)
    assert all(large[path] == pytest.approx(size * presentation.FONT_SCALE) for path, size in normal.items())
    assert "1 Router" in at.segmented_control(key="learn_step_widget").options  # the layout is the normal one
