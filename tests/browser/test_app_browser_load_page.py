"""The Load & collapse page in headless Chromium, over the corpus of the collapsed sample (its own server:
that sample is its default model): every reason is a list item of its own whose text is complete and not
clipped (scrollWidth ≤ clientWidth), and the losses chart draws one point per layer and form, at the
library's values. Screenshots load-verdicts.png, load-aux-loss.png (README pictures)."""

from __future__ import annotations

import pytest
from playwright.sync_api import Browser

from moeviz.analysis import AUX_LOSS_FORMS, CollapseThresholds, collapse_report, loss_frame
from tests.support.app import corpus_trace
from tests.support.browser import (
    RENDER_TIMEOUT_S,
    VIEWPORT,
    aria_fields,
    aria_labels,
    assert_no_error,
    charts_drawn,
    open_app,
    open_page,
    save_screenshot,
    wait_until_idle,
)

COLLAPSED = "sample:mixtral-collapsed"
FORMS = [form for form in AUX_LOSS_FORMS if form != "aux_loss_megatron"]  # drawn (Megatron's = top-k's)


@pytest.mark.slow
def test_reasons_and_losses_are_readable_in_the_browser(app_url, browser: Browser) -> None:
    trace = corpus_trace(COLLAPSED)
    report = collapse_report(trace, CollapseThresholds())
    expected = [r for lv in report.layers for r in lv.reasons] + [
        f"note: {n}" for lv in report.layers for n in lv.notes
    ]
    page = open_app(browser, app_url(COLLAPSED), viewport=VIEWPORT)
    try:
        open_page(page, "Load & collapse", "Load")
        page.get_by_text("Use the evaluation corpus").click()
        page.get_by_text("Model verdict: collapsed").first.wait_for(timeout=4 * RENDER_TIMEOUT_S * 1000)
        page.locator('.st-key-aux_losses [aria-roledescription="point"]').first.wait_for(
            timeout=RENDER_TIMEOUT_S * 1000
        )
        wait_until_idle(page)
        charts_drawn(page)
        assert_no_error(page)
        # the reasons and notes sit in collapsible sections (a summary line first): open the closed ones
        for summary in page.locator(".st-key-verdict_reasons details:not([open]) > summary").all():
            summary.click()
        wait_until_idle(page)
        items = page.eval_on_selector_all(
            ".st-key-verdict_reasons li li",
            "els => els.map(e => [e.innerText.trim(), e.scrollWidth, e.clientWidth])",
        )
        assert sorted(text for text, _, _ in items) == sorted(expected)
        clipped = [text for text, scroll, client in items if scroll > client]
        assert not clipped, clipped
        points = [
            aria_fields(a) for a in aria_labels(page, '.st-key-aux_losses [aria-roledescription="point"]')
        ]
        losses = loss_frame(trace).set_index("layer")
        shown = {(int(p["layer"]), p["form"]): p["loss"] for p in points}
        assert len(points) == len(shown) == len(trace.layer_keys) * len(FORMS)  # one point a layer and form
        assert shown == {
            (int(layer), form): f"{losses.loc[layer, form]:.4f}" for layer in losses.index for form in FORMS
        }
        save_screenshot(page, "load-verdicts", page.locator(".st-key-verdict_reasons"))
        save_screenshot(page, "load-aux-loss", page.locator(".st-key-aux_losses"))
    finally:
        page.close()
