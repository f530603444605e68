"""The Attention page in headless Chromium: the KV-cache what-if sizes and the head grids' colour scales as
rendered, with screenshots of both (attention-kv-whatif.png, attention-grid-scale.png; see
tests/support/browser.py for where they go)."""

from __future__ import annotations

import re

from playwright.sync_api import Browser

import moeviz
from tests.support.app import expected_cache_bytes
from tests.support.browser import (
    MODEL,
    RENDER_TIMEOUT_S,
    aria_labels,
    assert_no_error,
    next_frames,
    open_app,
    open_page,
    save_screenshot,
    wait_until_idle,
    wait_until_shown,
)


def test_attention_kv_whatif_and_grid_scales(app_url, browser: Browser, sample_model) -> None:
    page = open_app(browser, app_url(MODEL))
    try:
        example = page.locator(".st-key-routing_prompt textarea").input_value()
        tokens = int(moeviz.capture(sample_model, example, attention=True).attention.lengths.max())
        open_page(page, "Attention")

        # the local-mass grid's colour legend runs from 0 to 1 whatever the (near-constant) values are
        legend = '.st-key-heads_mean_local_mass [aria-roledescription="legend"]'
        page.locator(legend).first.wait_for(timeout=RENDER_TIMEOUT_S * 1000)
        wait_until_idle(page)
        labels = aria_labels(page, legend)
        assert labels and re.search(r"values from 0(\.0)? to 1(\.0)?$", labels[0]), labels
        entropy = aria_labels(page, '.st-key-heads_mean_entropy [aria-roledescription="legend"]')
        top = re.search(r"values from 0(?:\.0)? to ([\d.]+)", entropy[0])
        assert top and float(top[1]) >= 2.5, entropy  # [0, log T] nats; log 28 = 3.33 (ticks may round)

        # the what-if: the page's default W (half the longest sequence, at most 256) and G (4), sizes by hand
        # from config.json. Inputs and caption are re-read until they agree: while a run is drawn an input
        # may show another value than the one the caption was computed with (seen once in CI)
        caption = page.get_by_text(re.compile(r"The cache (of every layer )?would hold"))
        caption.wait_for(timeout=RENDER_TIMEOUT_S * 1000)
        wait_until_idle(page)
        full = expected_cache_bytes(tokens)
        default = (min(256, max(tokens // 2, 1)), 4)

        def what_if(page) -> tuple[int, int, bool]:
            """(W, G) as the inputs show them, and whether the caption gives the sizes of those."""
            window = int(page.get_by_label("Keep the last W keys").input_value())
            global_tokens = int(page.get_by_label("… plus the first G tokens").input_value())
            kept = expected_cache_bytes(tokens, window, global_tokens)
            text = caption.inner_text()
            sizes = f"hold {kept / 2**20:.2f} MiB instead of {full / 2**20:.2f} MiB" in text
            return window, global_tokens, sizes and f"(saves {1 - kept / full:.0%})" in text

        shown = wait_until_shown(page, what_if, (*default, True))
        assert shown == (*default, True), (shown, caption.inner_text())
        assert expected_cache_bytes(tokens, *default) < full
        assert_no_error(page)

        caption.evaluate("e => e.scrollIntoView({block: 'end'})")  # the what-if chart and its caption
        next_frames(page)
        save_screenshot(page, "attention-kv-whatif")
        # the mass grids: W = 32 covers all 28 tokens, so every head's local mass is 1 up to rounding
        page.locator(".st-key-heads_mean_sink_mass").evaluate("e => e.scrollIntoView({block: 'center'})")
        next_frames(page)
        save_screenshot(page, "attention-grid-scale")
    finally:
        page.close()
