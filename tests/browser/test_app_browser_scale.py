"""Every page at scale in the real browser (headless Chromium): the app opened on random DeepSeek-V3-shaped
(256 experts × 61 blocks) and Kimi-K2-shaped (384 experts) models shows no error, draws every Vega chart,
and hides no label of an expert, layer or value axis (Vega's overlap removal gives a dropped label opacity
0: none may have it in any chart drawn as SVG; token axes "pos:token" of windows up to 200 tokens thin their
labels by design), and shows the model's routing as the library captures it (the Routing caption's tokens
and MoE layers, every "MoE layer" axis listing the model's MoE layers, the About page's experts, top-k and
layers); a screenshot of each page is scale-<model>-<page>.png (see tests/support/browser.py for where it
goes). One server per shape (conftest's `app_url`), on a real random model: the pages run it. The Corpus
page traces the evaluation corpus with the model; the Checkpoints page opens a series of three Kimi-K2-shaped
checkpoints typed as a local folder (the 61-block shape would take too long to trace three times)."""

from __future__ import annotations

import itertools
import re

import pytest
from playwright.sync_api import Browser, Page

import moeviz
from tests.support.browser import (
    RENDER_TIMEOUT_S,
    assert_no_error,
    charts_drawn,
    open_app,
    save_screenshot,
    wait_for_heading,
    wait_until_idle,
)
from tests.support.scale_models import SHAPES, save_scale_series, with_tokenizer

VIEWPORT = {"width": 1200, "height": 900}
PAGES = {  # navigation title -> (screenshot name, key of the container of the chart to wait for and show)
    "Routing": ("routing", "strip"),
    "Load & collapse": ("load", "load_heatmap"),
    "Structure": ("structure", "coactivation"),
    "Attention": ("attention", "heads_mean_entropy"),
    "Compare": ("compare", "load_a"),
    "About the model": ("about", "bias"),
    "Why this expert?": ("why", None),
    "Corpus": ("corpus", "corpus_specialisation"),  # its load heatmap is the Load page's
}
SLOW_S = {"Corpus": 300}  # the Corpus page first traces 2 × 256 tokens of each domain (61 blocks: ~40 s)
# Per chart on the page: drawn (a canvas or SVG marks of non-zero size), SVG or not, and for SVG charts the
# labels of each axis by its title and those Vega's overlap removal hid (opacity 0).
_CHARTS_JS = """() => [...document.querySelectorAll('.vega-embed')].map(embed => {
  const canvas = embed.querySelector('canvas');
  const svg = embed.querySelector('svg.marks');
  const drawn = canvas || svg;
  const box = drawn ? drawn.getBoundingClientRect() : {width: 0, height: 0};
  const labels = svg ? [...svg.querySelectorAll('.role-axis-label text')] : [];
  const hidden = labels.filter(t => (t.getAttribute('opacity') === '0' || t.style.opacity === '0')
                                    && !/^[0-9]+:/.test(t.textContent));  // token axes thin their labels
  const title = embed.querySelector('.role-title-text');
  const axes = svg ? [...svg.querySelectorAll('.role-axis')].map(axis => [
    axis.querySelector('.role-axis-title text')?.textContent || '',
    [...axis.querySelectorAll('.role-axis-label text')].map(t => t.textContent)]) : [];
  return {title: title ? title.textContent : '', drawn: box.width > 0 && box.height > 0, svg: !!svg,
          labels: labels.length, hidden: hidden.map(t => t.textContent), axes};
})"""


@pytest.fixture(params=list(SHAPES))
def scale_app(request, tiny_model_dir, app_url):
    """(shape name, its model's folder, URL of the app on it): one server per shape."""
    folder = with_tokenizer(tiny_model_dir("deepseek_v3", **SHAPES[request.param]))
    return request.param, folder, app_url(str(folder))


def drawn_charts(page: Page) -> list[dict]:
    """`_CHARTS_JS` once every chart on the page is drawn (Vega draws after Streamlit's run ends)."""
    charts_drawn(page)
    return page.evaluate(_CHARTS_JS)


def test_every_page_at_scale(scale_app, browser: Browser) -> None:
    name, folder, url = scale_app
    page = open_app(browser, url, viewport=VIEWPORT)
    try:
        loaded = moeviz.load_model(str(folder))
        trace = moeviz.capture(loaded, page.locator(".st-key-routing_prompt textarea").input_value())
        layers = [str(layer) for _, layer in trace.layer_keys]
        caption = page.get_by_text(re.compile(r"DeepseekV3ForCausalLM · \d+ tokens"))
        assert f"· {len(trace.tokens)} tokens · {len(layers)} MoE layers" in caption.inner_text()
        dropped = {}
        for title, (shot, key) in PAGES.items():
            if title != "Routing":
                page.get_by_role("link", name=title).click()
            wait_for_heading(page, title.split(" ")[0].rstrip("?"))
            if key is not None:
                page.locator(f".st-key-{key} canvas, .st-key-{key} svg.marks").first.wait_for(
                    timeout=SLOW_S.get(title, RENDER_TIMEOUT_S) * 1000
                )
            wait_until_idle(page)
            assert_no_error(page)
            charts = drawn_charts(page)
            assert all(c["drawn"] for c in charts), [c["title"] for c in charts if not c["drawn"]]
            dropped.update({f"{title}: {c['title']}": c["hidden"] for c in charts if c["hidden"]})
            own = [c for c in charts if not c["title"].startswith("B: ")]  # Compare's B is another model
            for chart in own:  # an axis of MoE layers lists the model's: every one, or every n-th
                for axis, labels in chart["axes"]:
                    if axis == "MoE layer":
                        assert _every_nth(labels, layers), (title, chart["title"], labels)
            if title == "About the model":
                metrics = page.eval_on_selector_all(
                    '[data-testid="stMetric"]',
                    "els => els.map(e => e.innerText.split('\\n').filter(Boolean))",
                )
                shown = {label: value for label, value, *_ in metrics}
                assert shown["Routed experts"] == str(SHAPES[name]["n_routed_experts"])
                assert shown["Top-k"] == str(trace.layers[0].k)
                assert shown["MoE layers"] == str(len(layers))
            if key is not None:
                page.locator(f".st-key-{key}").first.evaluate("e => e.scrollIntoView({block: 'start'})")
            else:
                page.evaluate("window.scrollTo(0, 0)")
            save_screenshot(page, f"scale-{name}-{shot}")
        assert not dropped, f"axis labels dropped by overlap removal: {dropped}"
    finally:
        page.close()


@pytest.fixture(scope="module")
def scale_series(tmp_path_factory):
    """Three checkpoints of the Kimi-K2 shape (384 experts, 8 blocks)."""
    return save_scale_series("kimi-k2", tmp_path_factory.mktemp("series") / "kimi-k2-series")


def test_checkpoints_at_scale(app_url, tiny_model_dir, scale_series, browser: Browser) -> None:
    """On the Kimi-K2 shape's server (the series is Kimi-K2-shaped: tracing 61 blocks three times takes too
    long)."""
    name = "kimi-k2"
    url = app_url(str(with_tokenizer(tiny_model_dir("deepseek_v3", **SHAPES[name]))))
    page = open_app(browser, url, viewport=VIEWPORT)
    try:
        page.get_by_role("link", name="Checkpoints").click()
        wait_for_heading(page, "Checkpoints")
        page.get_by_role("combobox", name="Checkpoint series").click()
        page.get_by_role("option", name="Local folder…").click()
        folder = page.locator(".st-key-series_folder input")
        folder.fill(str(scale_series))
        folder.press("Enter")
        folder.blur()
        page.get_by_text("kimi-k2-series · 3 checkpoints").wait_for(timeout=300 * 1000)
        page.locator(".st-key-specialisation_timeline svg.marks").wait_for(timeout=RENDER_TIMEOUT_S * 1000)
        wait_until_idle(page)
        assert_no_error(page)
        charts = drawn_charts(page)
        assert len(charts) == 4 and all(c["drawn"] for c in charts), [c["title"] for c in charts]
        dropped = {c["title"]: c["hidden"] for c in charts if c["hidden"]}
        assert not dropped, f"axis labels dropped by overlap removal: {dropped}"
        page.evaluate("window.scrollTo(0, 0)")  # the series, then its saturation chart
        save_screenshot(page, f"scale-{name}-checkpoints")
    finally:
        page.close()


def _every_nth(labels: list[str], layers: list[str]) -> bool:
    """`labels` are the model's MoE layers, all of them or (where a band is too narrow for every label:
    `moeviz.charts._common.layer_band_axis`) every n-th from the first, ending on the last."""
    if labels == layers:
        return True
    if not labels or labels[0] != layers[0] or labels[-1] != layers[-1]:
        return False
    at = [layers.index(label) for label in labels if label in layers]
    steps = {b - a for a, b in itertools.pairwise(at)}
    return len(at) == len(labels) and len(steps - {max(steps)}) <= 1 and min(steps) >= 1
