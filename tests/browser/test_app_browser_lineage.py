"""The lineage warning and the checkpoint progress in headless Chromium (tests/app/test_app_lineage.py drives
both pages in-process): Compare on two separately trained samples says so above its views, with the
library's reason; the Checkpoints page shows its controls, then one status line per checkpoint of the
series, in order. Screenshots compare-unrelated.png and checkpoints-progress.png (README pictures)."""

from __future__ import annotations

from playwright.sync_api import Browser

from moeviz.analysis import lineage
from moeviz.models.loading import sample_models_dir
from moeviz.store.checkpoints import resolve_series
from tests.support.browser import (
    MODEL,
    RENDER_TIMEOUT_S,
    VIEWPORT,
    charts_drawn,
    open_app,
    open_page,
    save_screenshot,
    wait_until_idle,
)

COMPARED_WITH = "sample:mixtral-unbalanced"  # the Compare page's default model B
SERIES = sample_models_dir() / "mixtral-healthy-series"  # the Checkpoints page's default series


def test_the_lineage_warning_and_the_checkpoint_progress(app_url, browser: Browser) -> None:
    page = open_app(browser, app_url(MODEL), viewport=VIEWPORT)
    try:
        # Compare: the default pair was trained separately; the page says why, as the library does
        expected = lineage(MODEL, COMPARED_WITH)
        assert expected.checked and not expected.related
        open_page(page, "Compare")
        warning = page.locator('[data-testid="stAlertContentWarning"]', has_text="not one training run")
        warning.wait_for(timeout=RENDER_TIMEOUT_S * 1000)
        charts_drawn(page)
        text = warning.inner_text()
        assert f"A and B are not one training run ({expected.reason}). Expert ids" in text, text
        assert "each model's own load balance" in text
        first_chart = page.locator(".vega-embed").first.bounding_box()
        assert warning.bounding_box()["y"] < first_chart["y"]  # above every view
        save_screenshot(page, "compare-unrelated")

        # Checkpoints: one line per checkpoint of the series, in order, under a collapsed status block
        _, checkpoints = resolve_series(str(SERIES))
        labels = [label for label, _ in checkpoints]
        n = len(labels)
        page.get_by_role("link", name="Checkpoints", exact=True).click()
        status = page.locator('[data-testid="stExpander"]', has_text=f"Traced {n} checkpoints")
        status.wait_for(timeout=5 * RENDER_TIMEOUT_S * 1000)
        wait_until_idle(page, 5 * RENDER_TIMEOUT_S)
        controls = page.locator(".st-key-saturation_kind").bounding_box()
        assert controls["y"] < status.bounding_box()["y"]  # the controls come first
        # its lines, collapsed or not (textContent: a closed expander's text is not rendered)
        lines = status.evaluate("e => [...e.querySelectorAll('p')].map(p => p.textContent.trim())")
        lines = [line for line in lines if line.startswith("Traced checkpoint")]
        assert lines == [f"Traced checkpoint {label} ({i + 1}/{n})" for i, label in enumerate(labels)]
        save_screenshot(page, "checkpoints-progress")
    finally:
        page.close()
