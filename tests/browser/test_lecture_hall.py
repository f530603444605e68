"""The projector layout in the real browser: at 1280 × 720 with "Projector layout" on, every Learn step fits
the screen (the main area needs no scrolling: its scroll height is at most the viewport's), and the step bar
(previous, the steps, next) is one row inside the page at 1280 and at 900 px. One session walks the steps
with the next button. Screenshots: lecture-step<N>.png, lecture-steps-900.png (see tests/support/browser.py
for where they go)."""

from __future__ import annotations

from playwright.sync_api import Browser, Page

from tests.support.browser import (
    MODEL,
    after_run,
    assert_no_error,
    charts_drawn,
    next_frames,
    open_app,
    open_page,
    save_screenshot,
)

PROJECTOR = {"width": 1280, "height": 720}
# The main area's scroll height against its height, and the step bar's buttons (previous, every step,
# next): their boxes, and the right edge of the page's content they must stay inside.
_MEASURE_JS = """() => {
  const main = document.querySelector('[data-testid="stMain"]');
  const block = document.querySelector('[data-testid="stMainBlockContainer"]').getBoundingClientRect();
  const buttons = [...document.querySelectorAll('.st-key-learn_steps button')]
    .filter(b => b.getBoundingClientRect().width > 0)
    .map(b => { const r = b.getBoundingClientRect();
                return {text: b.innerText.trim(), top: r.top, bottom: r.bottom, right: r.right}; });
  return {scroll: main.scrollHeight, height: main.clientHeight, right: block.right, buttons};
}"""


def measure(page: Page) -> dict:
    charts_drawn(page)
    next_frames(page)
    return page.evaluate(_MEASURE_JS)


def assert_one_row(bar: dict, width: int) -> None:
    """The step options share one top, the previous / next buttons sit on their row (same vertical centre),
    and nothing is cut at the page's right edge."""
    buttons = bar["buttons"]
    assert len(buttons) >= 10, buttons  # previous, the (eight or nine) steps, next
    steps = buttons[1:-1]
    assert {round(b["top"]) for b in steps} == {round(steps[0]["top"])}, (
        f"the steps wrap at {width} px: {steps}"
    )
    centre = (steps[0]["top"] + steps[0]["bottom"]) / 2
    for button in (buttons[0], buttons[-1]):
        assert abs((button["top"] + button["bottom"]) / 2 - centre) <= 2, (
            f"{button} off the row at {width} px"
        )
    cut = [b["text"] for b in buttons if b["right"] > bar["right"] + 1]
    assert not cut, f"cut at the page's edge at {width} px: {cut}"


def test_every_learn_step_fits_a_projector_and_the_step_bar_is_one_row(app_url, browser: Browser):
    page = open_app(browser, app_url(MODEL), viewport=PROJECTOR)
    try:
        open_page(page, "Learn", "Learn")
        toggle = page.locator('[data-testid="stSidebar"] label').filter(has_text="Projector layout")
        after_run(page, lambda: toggle.click())
        steps = len(page.evaluate(_MEASURE_JS)["buttons"]) - 2
        too_tall = {}
        for number in range(1, steps + 1):
            if number > 1:
                after_run(page, lambda: page.locator(".st-key-learn_next button:visible").click())
            page.get_by_role("heading", level=3).filter(has_text=f"{number} ·").wait_for()
            assert_no_error(page)
            shown = measure(page)
            assert_one_row(shown, PROJECTOR["width"])
            save_screenshot(page, f"lecture-step{number}")
            if shown["scroll"] > shown["height"]:
                too_tall[number] = shown["scroll"]
        assert not too_tall, (
            f"steps taller than the {PROJECTOR['height']} px screen (scroll height): {too_tall}"
        )

        page.set_viewport_size({"width": 900, "height": 720})
        assert_one_row(measure(page), 900)
        save_screenshot(page, "lecture-steps-900")
    finally:
        page.close()
