"""The Engines page in headless Chromium: on first open (the sidebar model at bfloat16 against float32, the
example prompt) its headline and router mismatch are what `moeviz.analysis.engine_diff` computes from the
same two captures made here; with the sidebar switched to the DeepSeek-V3-style sample, whose bf16 router
flips some expert sets, the headline's count of differing (token, layer) is the library's too."""

from __future__ import annotations

from playwright.sync_api import Browser, Page

import moeviz
from moeviz.analysis.engine_diff import engine_diff
from tests.support.browser import (
    MODEL,
    RENDER_TIMEOUT_S,
    after_run,
    assert_no_error,
    charts_drawn,
    open_app,
    open_page,
    save_screenshot,
    wait_until_shown,
)

FLIPS = "sample:deepseek-v3-bias"


def library_diff(model: str, text: str):
    bf16, fp32 = (moeviz.load_model(model, dtype=dtype) for dtype in ("bfloat16", "float32"))
    return engine_diff(moeviz.capture(bf16, text), moeviz.capture(fp32, text))


def headline(page: Page) -> str:
    """The text of the page's verdict box ("… of … (token, layer) differ …")."""
    boxes = page.locator('[data-testid="stAlert"]').filter(has_text="(token, layer) differ")
    return boxes.first.inner_text() if boxes.count() else ""


def metric(page: Page, label: str) -> str:
    box = page.locator('[data-testid="stMetric"]').filter(has_text=label).first
    return box.locator('[data-testid="stMetricValue"]').inner_text()


def expected_headline(diff) -> str:
    return f"{diff.mismatched:,} of {diff.pairs:,} (token, layer) differ"


def test_the_headline_is_the_librarys_diff(app_url, browser: Browser) -> None:
    page = open_app(browser, app_url(MODEL))
    try:
        text = page.locator(".st-key-routing_prompt textarea").input_value()
        open_page(page, "Engines", timeout_s=2 * RENDER_TIMEOUT_S)
        charts_drawn(page)
        assert_no_error(page)
        diff = library_diff(MODEL, text)
        shown = wait_until_shown(page, lambda p: expected_headline(diff) in headline(p), True)
        assert shown, headline(page)
        assert metric(page, "Router mismatch") == f"{diff.router_mismatch:.2%}"
        save_screenshot(page, "engines")

        # the DeepSeek-V3-style sample: bf16 flips some of its expert sets
        def choose() -> None:
            page.get_by_role("combobox", name="Model").click()
            page.get_by_role("option", name=FLIPS).click()

        after_run(page, choose, timeout_s=2 * RENDER_TIMEOUT_S)
        diff = library_diff(FLIPS, text)
        assert diff.mismatched > 0
        shown = wait_until_shown(page, lambda p: expected_headline(diff) in headline(p), True)
        assert shown, headline(page)
        assert f"router mismatch {diff.router_mismatch:.2%}" in headline(page)
        assert metric(page, "Router mismatch") == f"{diff.router_mismatch:.2%}"
        charts_drawn(page)
        assert_no_error(page)
    finally:
        page.close()
