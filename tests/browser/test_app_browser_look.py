"""The Routing page in both themes and at both ends of the supported widths (900 and 1400 px), in the real
browser: chart titles and subtitles are readable on the page's background (contrast ≥ 4.5:1, WCAG AA),
the chosen-expert outlines follow the theme, token labels of the strip never overlap, the token's score
heatmap keeps a usable width, no legend and no metric label is cut; and the page looks like its committed
picture, docs/screenshots/routing-<theme>-<width>.png (`assert_matches_snapshot`: at most 1% of the pixels
differ beyond antialiasing; `make screenshots` renews the pictures).
"""

from __future__ import annotations

import itertools

import pytest
from playwright.sync_api import Browser, Page

from tests.support.browser import (
    MODEL,
    RENDER_TIMEOUT_S,
    assert_matches_snapshot,
    assert_no_error,
    charts_drawn,
    open_app,
    save_screenshot,
    wait_until_idle,
)

# Every title / subtitle text of the SVG charts with its fill, the page's background colour, the strip's
# label boxes per line, the token score heatmap's width against the main column's, and legends that
# overflow their chart's SVG.
_LOOK_JS = """() => {
  const rgb = c => (c.match(/[\\d.]+/g) || []).slice(0, 3).map(Number);
  const app = document.querySelector('[data-testid="stApp"]');
  const background = rgb(getComputedStyle(app).backgroundColor);
  const titles = [...document.querySelectorAll('.vega-embed svg .role-title text')].map(t => ({
    text: t.textContent, fill: rgb(getComputedStyle(t).fill)}));
  const strip = [...document.querySelectorAll('.st-key-strip svg .role-mark text')]
    .map(t => t.getBoundingClientRect()).filter(b => b.width > 0)
    .map(b => ({left: b.left, right: b.right, top: Math.round(b.top)}));
  const scores = document.querySelector('.st-key-token_scores .vega-embed');
  const main = document.querySelector('[data-testid="stMainBlockContainer"]');
  const cut = [...document.querySelectorAll('.vega-embed svg')].flatMap(svg => {
    const box = svg.getBoundingClientRect();
    return [...svg.querySelectorAll('.role-legend')].map(l => l.getBoundingClientRect())
      .filter(l => l.bottom > box.bottom + 1 || l.right > box.right + 1)
      .map(() => svg.closest('[class*="st-key-"]')?.className || '?');
  });
  const label = '[data-testid="stMetricLabel"]';
  const clipped = [...document.querySelectorAll(`${label}, ${label} *`)]
    .filter(e => e.clientWidth > 0 && e.scrollWidth > e.clientWidth + 1).map(e => e.textContent);
  return {background, titles, strip, cut, clipped,
          scoresWidth: scores ? scores.getBoundingClientRect().width : 0,
          mainWidth: main.getBoundingClientRect().width};
}"""


def luminance(rgb: list[float]) -> float:
    """WCAG relative luminance of an sRGB colour (0–255 channels)."""

    def linear(c: float) -> float:
        c = c / 255
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (linear(c) for c in rgb)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast(a: list[float], b: list[float]) -> float:
    """WCAG contrast ratio of two colours."""
    hi, lo = sorted((luminance(a), luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def open_routing(browser: Browser, url: str, theme: str, width: int) -> Page:
    page = open_app(browser, url, viewport={"width": width, "height": 3000}, color_scheme=theme)
    page.locator(".st-key-token_path svg.marks").wait_for(timeout=RENDER_TIMEOUT_S * 1000)
    # the strip's labels too: its fragment may mount after the drill-down's chart (`charts_drawn` only
    # waits for the charts already on the page)
    page.locator(".st-key-strip svg .role-mark text").first.wait_for(timeout=RENDER_TIMEOUT_S * 1000)
    wait_until_idle(page)
    charts_drawn(page)
    assert_no_error(page)
    return page


@pytest.mark.parametrize(("theme", "width"), [("dark", 900), ("light", 900), ("dark", 1400), ("light", 1400)])
def test_routing_page_reads_in_both_themes_and_widths(app_url, browser: Browser, theme: str, width: int):
    page = open_routing(browser, app_url(MODEL), theme, width)
    try:
        look = page.evaluate(_LOOK_JS)
        dark_page = luminance(look["background"]) < 0.2
        assert dark_page == (theme == "dark"), look["background"]  # the page did follow the browser
        assert look["titles"], "no chart title found"
        faint = [(t["text"], round(contrast(t["fill"], look["background"]), 2)) for t in look["titles"]]
        faint = [(text, ratio) for text, ratio in faint if ratio < 4.5]
        assert not faint, f"chart titles or subtitles hard to read on the {theme} theme: {faint}"
        lines: dict[int, list[dict]] = {}
        for box in look["strip"]:
            lines.setdefault(box["top"], []).append(box)
        overlaps = []
        for boxes in lines.values():
            boxes = sorted(boxes, key=lambda box: box["left"])
            overlaps += [(a, b) for a, b in itertools.pairwise(boxes) if a["right"] > b["left"] + 0.5]
        assert len(look["strip"]) >= 20, look["strip"]
        assert not overlaps, f"token labels overlap at {width} px: {overlaps[:3]}"
        assert look["scoresWidth"] >= 0.6 * look["mainWidth"], (look["scoresWidth"], look["mainWidth"])
        assert not look["cut"], f"legends cut by their chart: {look['cut']}"
        assert not look["clipped"], f"metric labels cut at {width} px: {look['clipped']}"
        clip = {"x": 0, "y": 0, "width": width, "height": 2000}  # strip, heatmap and the token drill-down
        assert_matches_snapshot(save_screenshot(page, f"routing-{theme}-{width}", clip=clip))
    finally:
        page.close()
