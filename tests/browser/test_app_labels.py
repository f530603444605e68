"""No chart of the Corpus and Structure pages drops a category label, in the real browser.

On the bundled default sample, for every chart drawn as SVG: no axis label has opacity 0 (Vega's overlap
removal), is cut short with "…" (label limit) or touches its neighbour (too little room per category, which
is what made Vega hide every other one before `keep_labels`); the Corpus specialisation rows name every
evaluation domain; the expert-paths chart labels every bar; the transition panels label every expert.
Screenshots: labels-<page>.png (see tests/support/browser.py for where they go).
"""

from __future__ import annotations

import pytest
from playwright.sync_api import Browser, Page

from moeviz.samples import DOMAINS
from tests.support.browser import (
    MODEL,
    RENDER_TIMEOUT_S,
    assert_no_error,
    charts_drawn,
    next_frames,
    open_app,
    save_screenshot,
    wait_for_heading,
    wait_until_idle,
)

VIEWPORT = {"width": 1200, "height": 900}
CORPUS_S = 300  # the Corpus page first traces the evaluation corpus into a store
# Per SVG chart in the container `key`: every axis label and header label (facet titles), with whether it
# is hidden (opacity 0) or cut short ("…"), and the aria-labels of its marks (their tooltip fields).
_LABELS_JS = """scope => [...document.querySelectorAll(`${scope} .vega-embed`)].map(embed => {
  const svg = embed.querySelector('svg.marks');
  if (!svg) return null;
  const hidden = t => t.getAttribute('opacity') === '0' || t.style.opacity === '0'
                      || getComputedStyle(t).opacity === '0';
  const read = role => [...svg.querySelectorAll(`.${role} text`)].map(t => ({
    text: t.textContent, hidden: hidden(t), cut: t.textContent.endsWith('…')}));
  // Labels of one axis that touch (boxes less than 1 px apart): drawn, but one hides the other.
  const touching = [];
  for (const axis of svg.querySelectorAll('.role-axis')) {
    const boxes = [...axis.querySelectorAll('.role-axis-label text')].filter(t => !hidden(t))
      .map(t => [t.textContent, t.getBoundingClientRect()]);
    boxes.forEach(([a, p], i) => boxes.slice(i + 1).forEach(([b, q]) => {
      if (p.left < q.right + 1 && q.left < p.right + 1 && p.top < q.bottom + 1 && q.top < p.bottom + 1)
        touching.push(`${a} | ${b}`);
    }));
  }
  return {axis: read('role-axis-label'), header: read('role-title-text'), touching,
          marks: [...svg.querySelectorAll('.role-mark path[aria-label], .role-mark [aria-label]')]
                   .map(m => m.getAttribute('aria-label'))};
})"""


@pytest.fixture(scope="module")
def page(browser: Browser, app_url):
    """One page (one session of the shared server) for every check of this module."""
    page = open_app(browser, app_url(MODEL), viewport=VIEWPORT)
    yield page
    page.close()


def open_page(page: Page, title: str, key: str, timeout_s: float = RENDER_TIMEOUT_S) -> None:
    page.get_by_role("link", name=title).click()
    wait_for_heading(page, title)
    page.locator(f".st-key-{key} svg.marks").first.wait_for(timeout=timeout_s * 1000)
    wait_until_idle(page)
    assert_no_error(page)
    charts_drawn(page)
    next_frames(page)  # Vega lays out again (and hides overlapping labels) once the chart has its width


def charts(page: Page, key: str | None = None) -> list[dict]:
    """The SVG charts in the container `key` (`exports.show_chart` keys them), or on the whole page."""
    found = [c for c in page.evaluate(_LABELS_JS, f".st-key-{key}" if key else "") if c is not None]
    assert found, f"no SVG chart in {key or 'the page'}"
    return found


def dropped(page: Page) -> list[list[str]]:
    """Per chart of the page with any: its axis and title labels that are hidden, cut short or touching."""
    lost = [
        [t["text"] for t in c["axis"] + c["header"] if t["hidden"] or t["cut"]] + c["touching"]
        for c in charts(page)
    ]
    return [bad for bad in lost if bad]


def shown(chart: dict, role: str = "axis") -> set[str]:
    return {t["text"] for t in chart[role] if not t["hidden"] and not t["cut"]}


def fields(aria: str) -> dict[str, str]:
    return dict(part.split(": ", 1) for part in aria.split("; ") if ": " in part)


def test_corpus_labels_every_domain(page: Page) -> None:
    open_page(page, "Corpus", "corpus_specialisation", CORPUS_S)
    assert not dropped(page), f"labels dropped on Corpus: {dropped(page)}"
    (spec,) = charts(page, "corpus_specialisation")
    assert set(DOMAINS) <= shown(spec), f"domain rows without a label: {set(DOMAINS) - shown(spec)}"
    page.locator(".st-key-corpus_specialisation").evaluate("e => e.scrollIntoView({block: 'start'})")
    save_screenshot(page, "labels-corpus")


def test_structure_labels_every_path_and_expert(page: Page) -> None:
    open_page(page, "Structure", "paths")
    assert not dropped(page), f"labels dropped on Structure: {dropped(page)}"
    (paths,) = charts(page, "paths")
    bars = {fields(a).get("path") for a in paths["marks"]} - {None}
    assert bars, "no bar of the expert-paths chart was read"
    assert bars <= shown(paths), f"paths without a label: {bars - shown(paths)}"
    (transitions,) = charts(page, "transitions")
    experts = {fields(a)[name] for a in transitions["marks"] for name in ("expert", "next_expert")}
    assert experts, "no cell of the transition panels was read"
    assert experts <= shown(transitions), f"experts without a label: {experts - shown(transitions)}"
    panels = {fields(a)["layers"] for a in transitions["marks"]}
    assert panels <= shown(transitions, "header"), f"panels without a title: {panels}"
    page.locator(".st-key-paths").evaluate("e => e.scrollIntoView({block: 'start'})")
    save_screenshot(page, "labels-structure-paths")
    page.locator(".st-key-transitions").evaluate("e => e.scrollIntoView({block: 'start'})")
    save_screenshot(page, "labels-structure-transitions")
