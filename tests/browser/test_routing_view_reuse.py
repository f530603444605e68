"""The Routing page keeps its drawn charts across a layer switch and an expert pick (real Chromium), at scale
and on the 8-expert sample.

At 256 experts, building a Vega view (compiling the spec, laying out, drawing) is most of what a layer
switch costs in the browser. Streamlit builds a new view only when a chart's spec changes and swaps the data
into the view it has when only the data changes; the page keeps its per-layer charts' specs free of the
layer and of the chosen expert so that it can. What is checked is that mechanism, not a time: the drawn
canvas or SVG node of each per-layer chart is the same node after the interaction (a new view replaces it),
while what it draws has changed (the new layer's data did arrive). Also the token's drill-down, drawn as
images: what its hover bins say under the pointer, against the library's capture. One random
DeepSeek-V3-shaped model (256 experts, 58 MoE layers: tests/support/scale_models.py), the app's example
prompt."""

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

CHARTS = ("heatmap", "strip", "load")  # the per-layer charts of the page (st.container keys)
SAMPLE = "sample:mixtral-healthy"  # the app's default: 8 experts, top-2, 4 MoE layers
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


def test_on_the_sample_a_layer_switch_keeps_the_drawn_views_too(app_url, browser) -> None:
    """Up to 20 experts as well (the 8-expert sample, the app's default): the per-layer charts name no
    layer either (the line above them does), so a layer switch swaps the new layer's data into them."""
    page = open_app(browser, app_url(SAMPLE), viewport={"width": 1400, "height": 1000})
    try:
        before = _tag(page)
        caption = page.get_by_text(re.compile(r"^Layer \d+: 8 experts, top-2")).first
        first = caption.inner_text()
        after_run(page, lambda: page.get_by_role("slider", name="MoE layer").press("ArrowRight"))
        after = _after(page, before, CHARTS)
        assert caption.inner_text() != first
        _assert_views_kept(before, after)
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


# The tooltip Vega shows under the pointer: its rows as [key, value], or null while none shows.
_TOOLTIP_JS = """() => {
  const tip = document.querySelector('#vg-tooltip-element.visible');
  if (!tip) return null;
  return [...tip.querySelectorAll('tr')].map(tr => [...tr.querySelectorAll('td')].map(td => td.textContent));
}"""


def _hover_until(page: Page, key: str, wanted: str) -> dict[str, str]:
    """Move the pointer over a grid of points of the chart `key` until a tooltip with the row `wanted` shows;
    → its rows."""
    box = page.locator(f".st-key-{key} canvas").first.bounding_box()
    assert box is not None
    for fy in (0.55, 0.65, 0.75, 0.45, 0.85):
        for fx in (0.5, 0.35, 0.65, 0.25, 0.75):
            page.mouse.move(box["x"] + fx * box["width"], box["y"] + fy * box["height"])
            next_frames(page)
            rows = page.evaluate(_TOOLTIP_JS)
            if rows and wanted in dict(rows):
                return dict(rows)
    raise AssertionError(f"no tooltip with {wanted!r} over {key}")


def test_a_tokens_drilldown_names_each_hovered_cell(scale_app, browser) -> None:
    """The token's drill-down at scale, drawn as images: hovering its layer × expert scores lists each
    expert's score of a bin, hovering the background of its rank path names the expert at each rank, both
    as the library's capture of the prompt has them."""
    folder, url = scale_app
    page = open_app(browser, url, viewport={"width": 1400, "height": 1000})
    try:
        prompt = page.locator(".st-key-routing_prompt textarea").input_value()
        trace = moeviz.capture(moeviz.load_model(folder), prompt)
        scores = {r.layer: r.scores[0] for r in trace.layers}  # the drill-down starts on the first token
        after_run(page, page.get_by_text("Show this token at every layer").click)
        for key in ("token_scores", "token_path"):
            page.locator(f".st-key-{key} canvas").first.wait_for(timeout=60_000)
        charts_drawn(page)
        assert_no_error(page)
        page.locator(".st-key-token_scores").scroll_into_view_if_needed()
        heat = _hover_until(page, "token_scores", "each cell")
        layer = int(heat["layer"])
        for cell in heat["each cell"].split(" · "):  # "expert: score", the experts of the bin
            expert, value = cell.split(": ")
            assert value == format(float(scores[layer][int(expert)]), ".4g"), (layer, cell)
        page.locator(".st-key-token_path").scroll_into_view_if_needed()
        path = _hover_until(page, "token_path", "each cell")
        ranked = np.argsort(-scores[int(path["layer"])], kind="stable")
        for cell in path["each cell"].split(" · "):  # "rank eX: score", X the expert at that rank
            where, value = cell.split(": ")
            rank, expert = (int(x) for x in where.split(" e"))
            assert expert == ranked[rank], (path["layer"], cell)
    finally:
        page.close()
