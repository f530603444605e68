"""The prompt form in headless Chromium (tests/app/test_app_inputs.py drives it in-process): a .png set on
the real uploader is refused, its message stays on a second Analyse, and neither press analyses anything."""

from __future__ import annotations

import re

from playwright.sync_api import Browser

from tests.support.browser import MODEL, RENDER_TIMEOUT_S, after_run, open_app, prompt_file_input


def test_in_the_browser_a_refused_png_is_not_analysed(app_url, browser: Browser, tmp_path) -> None:
    """Its message stays on Analyse, the caption's token count does not change, and the text typed in the
    box is not analysed in the file's place."""
    (tmp_path / "picture.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))
    page = open_app(browser, app_url(MODEL))
    try:
        caption = page.get_by_text(re.compile(r"MixtralForCausalLM · \d+ tokens"))
        caption.wait_for(timeout=RENDER_TIMEOUT_S * 1000)
        before = caption.inner_text()
        page.locator(".st-key-routing_prompt textarea").fill("typed words that the file was meant to replace")
        prompt_file_input(page).set_input_files(tmp_path / "picture.png")  # in the form: no run until Analyse
        page.get_by_text("picture.png").first.wait_for(timeout=RENDER_TIMEOUT_S * 1000)
        error = page.locator('[data-testid="stAlertContentError"]')
        for _ in range(2):  # the first press refuses the file, the second must not analyse the box
            after_run(page, page.get_by_role("button", name="Analyse").click)  # the run ends: all is drawn
            assert "picture.png is not a text file" in error.inner_text()
            assert caption.inner_text() == before
    finally:
        page.close()
