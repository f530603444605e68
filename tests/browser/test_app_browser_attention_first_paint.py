"""The Attention page paints its title and the head's map before any per-layer summary is computed: with
every summary held back (tests/support/summary_gate: a test hook the app server loads through PYTHONPATH),
the browser shows the title and the drawn map, and no head grid; once the summaries are let through, the
grid and the map's metrics follow in the same run."""

from __future__ import annotations

from pathlib import Path

import pytest
from playwright.sync_api import Browser
from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

from tests.support.browser import (
    MODEL,
    RENDER_TIMEOUT_S,
    assert_no_error,
    open_app,
    wait_for_heading,
    wait_until_idle,
)
from tests.support.server import running_app

GATE = Path(__file__).resolve().parents[1] / "support" / "summary_gate"
DRAWN = "(key) => !!document.querySelector('.st-key-' + key + ' canvas, .st-key-' + key + ' svg.marks')"


@pytest.fixture
def gated_app(tmp_path, monkeypatch):
    """An app server of its own on the sample whose attention summaries wait for `gate` to exist."""
    gate = tmp_path / "summaries-may-run"
    monkeypatch.setenv("PYTHONPATH", str(GATE))
    monkeypatch.setenv("ATTENTION_SUMMARY_GATE", str(gate))
    with running_app(MODEL) as url:
        yield url, gate
        gate.touch()  # never leave the server waiting


def test_map_is_drawn_before_the_summaries(gated_app, browser: Browser) -> None:
    url, gate = gated_app
    page = open_app(browser, url)
    try:
        page.get_by_role("link", name="Attention", exact=True).click()
        wait_for_heading(page, "Attention")
        # the summaries are held back: the map must come without them
        try:
            page.wait_for_function(f"() => ({DRAWN})('attention_map')", timeout=RENDER_TIMEOUT_S * 1000)
        except PlaywrightTimeoutError:
            raise AssertionError("the map was not drawn while the summaries were held back") from None
        assert not page.evaluate(f"() => ({DRAWN})('heads_mean_entropy')"), "the grid came before the gate"
        assert page.get_by_text("Kind", exact=True).count() == 0  # the map's metrics wait for its layer
        gate.touch()
        page.wait_for_function(f"() => ({DRAWN})('heads_mean_entropy')", timeout=RENDER_TIMEOUT_S * 1000)
        page.get_by_text("Kind", exact=True).first.wait_for(timeout=RENDER_TIMEOUT_S * 1000)
        wait_until_idle(page)
        assert_no_error(page)
    finally:
        page.close()
