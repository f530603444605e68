"""A new install's first page in Chromium: from the example prompt's routing bundled with the sample
(`moeviz.models.bundled_examples`; a model's kept routing, `moeviz.trace.kept`, is drawn the same way:
tests/app/test_app_first_page.py) the Routing page draws its views before torch is imported, and the token's
attention row, which waits for the import (saying so after half a second), follows in the same run; nothing
reruns after it."""

from __future__ import annotations

import time

from playwright.sync_api import Browser

from tests.support.browser import (
    MODEL,
    RENDER_TIMEOUT_S,
    VIEWPORT,
    assert_no_error,
    charts_drawn,
    runs,
    wait_until_idle,
    watch,
)
from tests.support.server import running_app

PENDING = "Loading torch and transformers to recompute this token's attention"
# the heatmap, the token's scores and the load chart: drawn while the attention row waits
VIEWS = ("heatmap", "token_scores", "load")


def test_a_new_installs_first_page_then_its_attention_row(browser: Browser, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MOEVIZ_CACHE_DIR", str(tmp_path))  # nothing kept yet; bundled examples read
    with running_app(MODEL) as url:
        page = watch(browser.new_page(viewport=VIEWPORT))
        page.goto(url, wait_until="domcontentloaded")
        for view in VIEWS:
            page.locator(f".st-key-{view} svg.marks, .st-key-{view} canvas").first.wait_for(
                timeout=RENDER_TIMEOUT_S * 1000
            )
        # drawn before torch: the row, which waits for its import (started after the page's views are
        # sent, a second or more), is not there yet
        assert page.get_by_text("Attention of", exact=False).count() == 0
        counter = runs(page)
        counter.wait_for_runs(0)  # the first run ends with the row drawn
        wait_until_idle(page)
        charts_drawn(page)
        assert page.get_by_text("Attention of", exact=False).count() >= 1
        assert page.get_by_text(PENDING, exact=False).count() == 0
        assert_no_error(page)
        finished = counter.finished
        time.sleep(3)
        assert counter.finished == finished  # nothing reruns once the row is drawn
        page.close()
    assert not (tmp_path / "traces").exists()  # drawn from the package's file, nothing kept
