"""A routing file as the pages' input, in headless Chromium: on Load & collapse, "an uploaded routing file"
and an engine's expert counts (a load table written as `moeviz import` writes one) give the verdict, and the
reasons under it, that `moeviz.analysis.collapse.load_collapse_report` gives the same file. Screenshot
routing-file-load.png."""

from __future__ import annotations

from playwright.sync_api import Browser

from moeviz.analysis.collapse import load_collapse_report
from moeviz.engines.layout import routing_layout
from moeviz.trace import ExpertLoad
from tests.support.browser import (
    MODEL,
    RENDER_TIMEOUT_S,
    after_run,
    assert_no_error,
    charts_drawn,
    open_app,
    open_page,
    save_screenshot,
    wait_until_idle,
)
from tests.support.traces import load_table_collapsing_layer_0


def load_table(folder) -> ExpertLoad:
    """Expert counts of 3 steps for the sidebar's sample (8 experts, top-2), every token of layer 0 sent to
    expert 0, saved as `folder`/counts.parquet."""
    load = load_table_collapsing_layer_0(routing_layout(MODEL), seed=1)
    load.to_parquet(folder / "counts.parquet")
    return load


def test_load_and_collapse_of_an_uploaded_load_table_gives_the_librarys_verdict(
    app_url, browser: Browser, tmp_path
) -> None:
    report = load_collapse_report(load_table(tmp_path))
    verdict = f"Model verdict: {report.verdict.name.lower()} (the worst layer's)."
    reasons = [r for lv in report.layers for r in lv.reasons] + [
        f"note: {n}" for lv in report.layers for n in lv.notes
    ]
    assert report.layers[0].reasons  # the pile on expert 0 is a reason
    page = open_app(browser, app_url(MODEL))
    try:
        open_page(page, "Load & collapse", "Load")
        after_run(page, page.get_by_text("an uploaded routing file").click)
        uploader = page.locator('.st-key-page_input_upload [data-testid="stFileUploaderDropzoneInput"]')
        after_run(page, lambda: uploader.set_input_files(tmp_path / "counts.parquet"))
        page.get_by_text(verdict).wait_for(timeout=RENDER_TIMEOUT_S * 1000)
        wait_until_idle(page)
        charts_drawn(page)
        assert_no_error(page)
        items = page.eval_on_selector_all(
            ".st-key-verdict_reasons li li", "els => els.map(e => e.innerText.trim())"
        )
        assert sorted(items) == sorted(reasons)
        assert page.get_by_text("A load table counts each layer's experts without tokens").count() == 1
        save_screenshot(page, "routing-file-load")
    finally:
        page.close()
