"""The Lab page in headless Chromium (tests/app/test_app_lab.py drives it in-process): Start makes the loss
curve grow, Pause stops it."""

from __future__ import annotations

from playwright.sync_api import Browser, Page

from tests.support.browser import MODEL, open_app, runs

TIMEOUT_S = 120  # a shared CI machine: the corpus, the first steps
# Points drawn in the loss chart's lines: each SVG line path is "M x,y L x,y L …", one command a point.
_LOSS_POINTS = """() => [...document.querySelectorAll(
    '.st-key-lab_loss path[aria-roledescription="line mark"]')]
  .reduce((n, p) => n + ((p.getAttribute('d') || '').match(/[ML]/g) || []).length, 0)"""


def open_lab(page: Page) -> None:
    """From the app's Routing page, the Lab from the navigation ("/lab" itself would run the page bare,
    without the app's navigation)."""
    page.get_by_role("link", name="Lab", exact=True).click(timeout=TIMEOUT_S * 1000)
    # the page drawn, or its exception (shown at once rather than as a Start button that never comes)
    page.locator(".st-key-lab_start button, [data-testid='stException']").first.wait_for(
        timeout=TIMEOUT_S * 1000
    )
    failure = page.locator("[data-testid='stException']")
    assert not failure.count(), failure.first.inner_text()


def test_browser_start_grows_the_curves_and_pause_stops_them(app_url, browser: Browser) -> None:
    page = open_app(browser, app_url(MODEL), viewport={"width": 1280, "height": 720})
    try:
        open_lab(page)
        page.locator(".st-key-lab_start button").first.click(timeout=TIMEOUT_S * 1000)

        def points_after(least: int) -> int:
            """Wait until the loss curve has more than `least` points (→ how many)."""
            page.wait_for_function(f"() => ({_LOSS_POINTS})() > {least}", timeout=TIMEOUT_S * 1000)
            return page.evaluate(_LOSS_POINTS)

        first = points_after(1)
        second = points_after(first)  # it grows while the model trains
        assert second > first
        page.locator(".st-key-lab_pause button").first.click(timeout=TIMEOUT_S * 1000)
        page.get_by_text("· paused").wait_for(timeout=TIMEOUT_S * 1000)
        counter = runs(page)
        # the curves refresh on their own (a fragment run every 2 s while paused): the first refresh shows
        # a step that was in flight when paused; from then on, two more refreshes draw no new point
        counter.wait_for_runs(counter.finished, 2, timeout_s=TIMEOUT_S)
        paused = page.evaluate(_LOSS_POINTS)
        counter.wait_for_runs(counter.finished, 2, timeout_s=TIMEOUT_S)
        assert page.evaluate(_LOSS_POINTS) == paused >= second
        page.locator(".st-key-lab_reset button").first.click()
        page.locator(".st-key-lab_start button:not([disabled])").first.wait_for(timeout=TIMEOUT_S * 1000)
    finally:
        page.close()


_CUT_TITLES = """() => [...document.querySelectorAll('[class*="st-key-lab_"] g.role-title text')]
  .map(t => t.textContent).filter(t => t.includes('…'))"""


def test_the_curves_titles_are_whole_on_a_900_px_screen(app_url, browser: Browser) -> None:
    """Two (three) curves side by side in the page's right column cut their titles to "Expert loa…" at 900 px:
    they wrap one under another there instead."""
    page = open_app(browser, app_url(MODEL), viewport={"width": 900, "height": 900})
    try:
        open_lab(page)
        page.locator(".st-key-lab_start button").first.click(timeout=TIMEOUT_S * 1000)
        page.wait_for_function(f"() => ({_LOSS_POINTS})() > 1", timeout=TIMEOUT_S * 1000)
        page.locator(".st-key-lab_load g.role-title text").first.wait_for(timeout=TIMEOUT_S * 1000)
        titles = page.evaluate(
            "() => [...document.querySelectorAll('[class*=\"st-key-lab_\"] g.role-title text')]"
            ".map(t => t.textContent)"
        )
        assert any(t.startswith("Expert load, layer") for t in titles), titles
        assert page.evaluate(_CUT_TITLES) == []
        page.locator(".st-key-lab_reset button").first.click()
    finally:
        page.close()
