"""The Routing page at scale keeps its drawn charts across a layer switch and an expert pick (real Chromium).

At 256 experts, building a Vega view (compiling the spec, laying out, drawing) is most of what a layer
switch costs in the browser. Streamlit builds a new view only when a chart's spec changes and swaps the data
into the view it has when only the data changes; the page keeps its per-layer charts' specs free of the
layer and of the chosen expert so that it can. What is checked is that mechanism, not a time: the drawn
canvas or SVG node of each per-layer chart is the same node after the interaction (a new view replaces it),
while what it draws has changed (the new layer's data did arrive). One random DeepSeek-V3-shaped model (256
experts, 58 MoE layers: tests/support/scale_models.py), the app's example prompt."""

from __future__ import annotations

import re

import numpy as np
import pytest
from playwright.sync_api import Page

import moeviz
from tests.support.browser import (
    after_run,
    assert_no_error,
    charts_drawn,
    next_frames,
    open_app,
    runs,
    wait_until_idle,
)
from tests.support.scale_models import SHAPES, with_tokenizer

CHARTS = ("heatmap", "strip", "load")  # the per-layer charts of the page at scale (st.container keys)
# Tags each chart's drawn node (a property set on the DOM node: a new view draws into a new node) and returns
# a signature of what each draws (canvas pixels, or the SVG's markup).
_TAG_JS = """([keys, tag]) => Object.fromEntries(keys.map(key => {
  const node = document.querySelector(`.st-key-${key} canvas, .st-key-${key} svg.marks`);
  if (!node) return [key, null];
  if (tag) node.__viewTag = key;
  const drawn = node.tagName === 'CANVAS' ? node.toDataURL() : node.innerHTML;
  let h = 0;
  for (let i = 0; i < drawn.length; i++) h = (h * 31 + drawn.charCodeAt(i)) | 0;
  return [key, {kept: node.__viewTag === key, drawn: h}];
}))"""


@pytest.fixture(scope="module")
def scale_app(tiny_model_dir, app_url) -> tuple[str, str]:
    """(the folder of a random DeepSeek-V3-shaped model, the URL of the app served on it)."""
    folder = str(with_tokenizer(tiny_model_dir("deepseek_v3", **SHAPES["deepseek-v3"])))
    return folder, app_url(folder)


# Whether every chart of `keys` has its drawn node (its fragment may still be mounting when a run has ended).
_NODES_JS = """keys => keys.every(key =>
  document.querySelector(`.st-key-${key} canvas, .st-key-${key} svg.marks`))"""


def _views_drawn(page: Page) -> None:
    charts_drawn(page)
    wait_until_idle(page)
    page.wait_for_function(_NODES_JS, arg=list(CHARTS), polling=100, timeout=60_000)


def _tag(page: Page) -> dict:
    _views_drawn(page)
    return page.evaluate(_TAG_JS, [list(CHARTS), True])


# Whether each chart of `keys` draws something else than it drew in `before` (signatures from _TAG_JS).
_REDRAWN_JS = f"""([keys, before]) => {{
  const now = ({_TAG_JS})([keys, false]);
  return keys.every(key => now[key] && before[key] && now[key].drawn !== before[key].drawn);
}}"""


def _after(page: Page, before: dict, changed: tuple[str, ...]) -> dict:
    _views_drawn(page)
    # Vega draws the swapped data after Streamlit's run has ended: until the charts `changed` show the new
    # data (in their view or a new one; Streamlit hands every chart its data in one go), then two frames
    page.wait_for_function(_REDRAWN_JS, arg=[list(changed), before], polling=100, timeout=60_000)
    next_frames(page)
    assert_no_error(page)
    return page.evaluate(_TAG_JS, [list(CHARTS), False])


def _assert_views_kept(before: dict, after: dict) -> None:
    assert all(before[key] for key in CHARTS), before  # every chart was drawn
    assert all(after[key] for key in CHARTS), after
    replaced = [key for key in CHARTS if not after[key]["kept"]]
    assert not replaced, f"a new Vega view was built for {replaced} (its spec changed)"


def test_layer_switch_and_expert_pick_keep_the_drawn_views(scale_app, browser) -> None:
    folder, url = scale_app
    page = open_app(browser, url, viewport={"width": 1400, "height": 1000})
    try:
        before = _tag(page)
        caption = page.get_by_text(re.compile(r"^Layer \d+: 256 experts, top-")).first
        first = caption.inner_text()
        after_run(page, lambda: page.get_by_role("slider", name="MoE layer").press("ArrowRight"))
        after = _after(page, before, CHARTS)  # the new layer's strip, scores and load
        assert caption.inner_text() != first  # the layer did switch
        _assert_views_kept(before, after)
        assert after["heatmap"]["drawn"] != before["heatmap"]["drawn"]  # ... and its scores were swapped in

        # an expert outside the top-N (the least loaded at this layer, from the library's own capture): one
        # row more in the heatmap and the overview, the strip and the curve outline it
        trace = moeviz.capture(
            moeviz.load_model(folder), page.locator(".st-key-routing_prompt textarea").input_value()
        )
        experts = np.asarray(trace.layers[1].experts).reshape(-1)
        quiet = int(np.argsort(np.bincount(experts[experts >= 0], minlength=256), kind="stable")[0])
        box = page.get_by_role("combobox", name="Expert", exact=True).first
        box.scroll_into_view_if_needed()
        box.click()
        page.keyboard.type(str(quiet))
        option = page.get_by_role("option", name=re.compile(rf"^{quiet} · ")).first
        option.wait_for()
        before = _tag(page)
        after_run(page, option.click)
        # its row and its mark on the curve (the strip outlines its tokens: likely none, it is the quietest)
        after = _after(page, before, ("heatmap", "load"))
        _assert_views_kept(before, after)
        assert after["heatmap"]["drawn"] != before["heatmap"]["drawn"]
    finally:
        page.close()


TITLES = ("Router scores", "Dispatch over the whole input", "Tokens by top-1 expert", "Expert load, sorted")


def _sent_charts(page: Page) -> list[str]:
    """Collects, from now on, the title (of TITLES) of every chart the server sends `page` (Streamlit's
    `ForwardMsg` deltas on the websocket), and the messages that reference a cached element instead
    ("ref")."""
    from streamlit.proto.ForwardMsg_pb2 import ForwardMsg

    sent: list[str] = []

    def frame(payload: str | bytes) -> None:
        if isinstance(payload, str):
            return
        msg = ForwardMsg()
        msg.ParseFromString(payload)
        if msg.WhichOneof("type") == "ref_hash":
            sent.append("ref")
        elif msg.WhichOneof("type") == "delta" and msg.delta.WhichOneof("type") == "new_element":
            element = msg.delta.new_element
            if element.WhichOneof("type") == "vega_lite_chart":
                spec = element.vega_lite_chart.spec
                sent.extend(title for title in TITLES if f'"text": "{title}' in spec)

    runs(page).socket.on("framereceived", frame)
    return sent


def test_a_sort_reruns_only_the_views_that_list_the_experts(scale_app, browser) -> None:
    """A sort changes the order of the heatmaps' rows alone: the server sends the heatmap again and not the
    token strip or the load curve (their fragment does not rerun), which stay drawn."""
    _, url = scale_app
    page = open_app(browser, url, viewport={"width": 1400, "height": 1000})
    try:
        before = _tag(page)
        sent = _sent_charts(page)
        box = page.get_by_role("combobox", name="Sort experts by", exact=True).first
        box.scroll_into_view_if_needed()
        box.click()
        after_run(page, page.get_by_role("option", name=re.compile("^load")).first.click)
        _views_drawn(page)
        assert_no_error(page)
        assert "ref" not in sent, sent  # every element sent is in the messages read here
        assert "Router scores" in sent, sent  # (the example prompt is too short for the binned overview)
        assert not {"Tokens by top-1 expert", "Expert load, sorted"} & set(sent), sent
        after = page.evaluate(_TAG_JS, [list(CHARTS), False])
        _assert_views_kept(before, after)
    finally:
        page.close()
