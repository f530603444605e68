"""Driving the served app in headless Chromium: opening it, waiting on Streamlit's run state (never a fixed
sleep), reading what the page shows, and screenshots (test code: it needs the repository and a browser).

Waiting: every page opened with `open_app` counts the script runs its session finished, from the
websocket's messages (Streamlit's `ForwardMsg`: `script_finished`, `session_status_changed`). `after_run`
performs an action and waits for the run it caused to end; `wait_until_idle` waits until no run is in flight
and no element is left stale from the previous run. Both give up at a deadline.

Screenshots: `save_screenshot` writes to `$MOEVIZ_SCREENSHOTS` when set (`make screenshots` sets it to
docs/screenshots: the README pictures), else to test-output/screenshots (ignored by git). A test run never
writes docs/. Where a picture is what a test checks, `assert_matches_snapshot` compares it with the
committed one in docs/screenshots, within a tolerance, and leaves the differences in test-output/diffs.
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import numpy as np
from playwright.sync_api import Browser, Page, WebSocket
from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

from tests.support.server import REPO

MODEL = "sample:mixtral-healthy"  # the app's default, and the model of most browser tests
VIEWPORT = {"width": 1200, "height": 1000}
RENDER_TIMEOUT_S = 60  # a page's run and its charts (a shared CI machine)
SNAPSHOTS = REPO / "docs" / "screenshots"  # the committed pictures (README; `make screenshots`)
OUTPUT = REPO / "test-output"  # what a test run leaves behind (in .gitignore)
# Every Vega chart on the page drawn: a canvas or SVG marks (Vega draws after Streamlit's run ends).
ALL_CHARTS_DRAWN = (
    "() => [...document.querySelectorAll('.vega-embed')].every(e => e.querySelector('canvas, svg.marks'))"
)
_IDLE_DOM = '() => !document.querySelector(\'[data-testid="stStatusWidget"], [data-stale="true"]\')'


# ---- Streamlit's run state, from the websocket ----------------------------------------------------------
class Runs:
    """The script runs of one page's session: how many finished, and whether one is in flight."""

    def __init__(self, page: Page) -> None:
        self.page = page
        self.finished = 0
        self.running = False
        self.socket: WebSocket | None = None
        page.on("websocket", self._attach)

    def _attach(self, socket: WebSocket) -> None:
        if "_stcore/stream" in socket.url:
            self.socket = socket
            socket.on("framereceived", self._frame)

    def _frame(self, payload: str | bytes) -> None:
        from streamlit.proto.ForwardMsg_pb2 import ForwardMsg

        if isinstance(payload, str):
            return
        msg = ForwardMsg()
        try:
            msg.ParseFromString(payload)
        except Exception:  # not a ForwardMsg (never seen; nothing to count)
            return
        kind = msg.WhichOneof("type")
        if kind == "new_session":  # sent as each run starts
            self.running = True
        elif kind == "session_status_changed":
            self.running = msg.session_status_changed.script_is_running
        elif kind == "script_finished":
            self.finished += 1
            self.running = False

    def wait(self, done: Callable[[], bool], what: str, timeout_s: float = RENDER_TIMEOUT_S) -> None:
        """Until `done()` (checked on every message the server sends), or fail at the deadline."""
        deadline = time.monotonic() + timeout_s
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{what}: not within {timeout_s}s")
            try:
                if self.socket is None or self.socket.is_closed():
                    self.page.wait_for_event("websocket", timeout=left * 1000)
                else:
                    self.socket.wait_for_event(
                        "framereceived", predicate=lambda _: done(), timeout=left * 1000
                    )
            except PlaywrightTimeoutError:
                raise AssertionError(f"{what}: not within {timeout_s}s") from None

    def wait_for_runs(self, since: int, count: int = 1, timeout_s: float = RENDER_TIMEOUT_S) -> None:
        """Until `count` more runs than `since` have finished and none is in flight."""
        self.wait(
            lambda: self.finished >= since + count and not self.running,
            f"{count} script run(s) after run {since}",
            timeout_s,
        )


_RUNS: weakref.WeakKeyDictionary[Page, Runs] = weakref.WeakKeyDictionary()


def runs(page: Page) -> Runs:
    """The run counter of a page opened with `open_app` (or `watch`)."""
    return _RUNS[page]


def watch(page: Page) -> Page:
    """Count `page`'s script runs (before it opens the app: the counter listens to its websocket)."""
    _RUNS[page] = Runs(page)
    return page


def open_app(browser: Browser, url: str, viewport: dict | None = None, **page_options) -> Page:
    """A new page (its own session) on the app's Routing page, once its first run has finished and the
    example prompt is in its box."""
    page = watch(browser.new_page(viewport=viewport or VIEWPORT, **page_options))
    page.goto(url, wait_until="domcontentloaded")
    runs(page).wait_for_runs(0, timeout_s=2 * RENDER_TIMEOUT_S)  # the first run: a model load, a capture
    page.locator(".st-key-routing_prompt textarea").wait_for(timeout=RENDER_TIMEOUT_S * 1000)
    page.wait_for_function(
        "() => document.querySelector('.st-key-routing_prompt textarea').value !== ''",
        timeout=RENDER_TIMEOUT_S * 1000,
    )
    return page


def after_run(page: Page, action: Callable[[], object], timeout_s: float = RENDER_TIMEOUT_S) -> None:
    """Do `action` (a click, a fill) and wait until the script run it caused has finished."""
    counter = runs(page)
    since = counter.finished
    action()
    counter.wait_for_runs(since, timeout_s=timeout_s)
    wait_until_idle(page, timeout_s)


def wait_until_idle(page: Page, timeout_s: float = RENDER_TIMEOUT_S) -> None:
    """Until no script run is in flight (when the page is watched) and no element is left stale from the
    previous run (no running indicator)."""
    counter = _RUNS.get(page)
    if counter is not None:
        counter.wait(lambda: not counter.running, "the script run in flight", timeout_s)
    page.wait_for_function(_IDLE_DOM, timeout=timeout_s * 1000)


def next_frames(page: Page) -> None:
    """Until the browser has laid out and painted twice (after a scroll or a resize: Vega re-lays out its
    charts on a resize observer)."""
    page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")


def charts_drawn(page: Page, timeout_s: float = RENDER_TIMEOUT_S) -> None:
    """Until every Vega chart on the page has drawn its marks."""
    page.wait_for_function(ALL_CHARTS_DRAWN, timeout=timeout_s * 1000)


# ---- what the page shows --------------------------------------------------------------------------------
def assert_no_error(page: Page) -> None:
    errors = page.locator('[data-testid="stException"], [data-testid="stAlertContentError"]')
    assert errors.count() == 0, f"the page shows an error:\n{errors.first.inner_text()}"


def wait_for_heading(page: Page, text: str, timeout_s: float = RENDER_TIMEOUT_S) -> None:
    """Wait until the page's title (h1) contains `text`: the page switched."""
    page.get_by_role("heading", level=1).filter(has_text=text).wait_for(timeout=timeout_s * 1000)


def open_page(
    page: Page, title: str, heading: str | None = None, timeout_s: float = RENDER_TIMEOUT_S
) -> None:
    """Click `title` in the navigation and wait for its page's heading and the end of its run."""
    page.get_by_role("link", name=title, exact=True).click()
    wait_for_heading(page, heading or title, timeout_s)
    wait_until_idle(page, timeout_s)


def prompt_file_input(page: Page):
    """The prompt form's file input, its expander ("Or a text file") opened first if it is closed (a click on
    an open one would close it: the chosen file's chip would then be hidden)."""
    details = page.locator('[data-testid="stExpander"] details').filter(has_text="Or a text file")
    if details.get_attribute("open") is None:
        details.locator("summary").click()
        page.wait_for_function("e => e.open", arg=details.element_handle(), timeout=RENDER_TIMEOUT_S * 1000)
    return page.locator('[data-testid="stFileUploaderDropzoneInput"]')


def aria_labels(page: Page, selector: str) -> list[str]:
    """The aria-label of every element matching `selector` (Vega marks carry their tooltip fields)."""
    return page.eval_on_selector_all(selector, "marks => marks.map(m => m.getAttribute('aria-label') || '')")


def aria_fields(label: str) -> dict[str, str]:
    """`"a: 1; b: x"` → {"a": "1", "b": "x"} (a Vega mark's aria-label)."""
    return dict(part.split(": ", 1) for part in label.split("; ") if ": " in part)


def marks(page: Page, key: str, role: str = "rect mark") -> int:
    """How many marks of `role` the chart in the container `key` draws."""
    return page.locator(f'.st-key-{key} [aria-roledescription="{role}"]').count()


def next_change(page: Page, at_most_ms: int = 500) -> None:
    """Until the page's DOM next changes (a rerun's element, a redrawn mark), or `at_most_ms` passes. A
    page that replaces its document meanwhile (Streamlit's page switch, a reload) drops the observer's
    promise: that is a change too."""
    from playwright.sync_api import Error

    try:
        page.evaluate(_NEXT_CHANGE_JS, at_most_ms)
    except Error as exc:
        if not any(gone in str(exc) for gone in _CONTEXT_GONE):
            raise


_CONTEXT_GONE = ("promise was garbage collected", "Execution context was destroyed")


_NEXT_CHANGE_JS = """ms => new Promise(resolve => {
  const observer = new MutationObserver(() => { observer.disconnect(); resolve(true); });
  observer.observe(document.body, {subtree: true, childList: true, attributes: true, characterData: true});
  setTimeout(() => { observer.disconnect(); resolve(false); }, ms);
})"""


def wait_until_shown(
    page: Page, read: Callable[[Page], object], expected, timeout_s: float = RENDER_TIMEOUT_S
):
    """Until what `read(page)` returns equals `expected` (Streamlit reruns and Vega redraws asynchronously),
    re-read at each change of the page; returns what was last shown (the caller asserts on it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert_no_error(page)
        shown = read(page)
        if shown == expected or time.monotonic() > deadline:
            return shown
        next_change(page)


# ---- screenshots ----------------------------------------------------------------------------------------
def screenshot_dir() -> Path:
    """Where screenshots go: $MOEVIZ_SCREENSHOTS (`make screenshots`: docs/screenshots), else
    test-output/screenshots."""
    folder = Path(os.environ.get("MOEVIZ_SCREENSHOTS") or OUTPUT / "screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def save_screenshot(page: Page, name: str, locator=None, clip: dict | None = None) -> Path:
    """The visible viewport (or one element, or a clip) as <screenshot_dir>/name.png; returns its path."""
    path = screenshot_dir() / f"{name}.png"
    if locator is not None:  # a tall viewport, so the element fits in Streamlit's scrolling main area
        size = page.viewport_size or VIEWPORT
        page.set_viewport_size({"width": size["width"], "height": 2200})
        next_frames(page)
        wait_until_idle(page)
        charts_drawn(page)
        locator.scroll_into_view_if_needed()
        next_frames(page)
        locator.screenshot(path=str(path))
        page.set_viewport_size(size)
        next_frames(page)
    else:
        page.screenshot(path=str(path), clip=clip)
    return path


def _pixels(path: Path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"), dtype=np.int16)


def differing_pixels(
    shot: np.ndarray, snapshot: np.ndarray, threshold: int = 48, shift: int = 1
) -> np.ndarray:
    """Mask of the pixels of `shot` that differ from `snapshot`: by more than `threshold` (0–255, in any
    channel) from every pixel of `snapshot` within `shift` pixels (antialiasing and a font's sub-pixel
    placement move edges by a pixel; that is not a difference)."""
    height, width, _ = shot.shape
    padded = np.pad(snapshot, ((shift, shift), (shift, shift), (0, 0)), mode="edge")
    best = np.full((height, width), 255, dtype=np.int16)
    for dy in range(2 * shift + 1):
        for dx in range(2 * shift + 1):
            near = padded[dy : dy + height, dx : dx + width]
            best = np.minimum(best, np.abs(shot - near).max(axis=2))
    return best > threshold


def assert_matches_snapshot(path: Path, tolerance: float = 0.01) -> None:
    """The screenshot at `path` looks like the committed docs/screenshots/<its name>: at most `tolerance`
    of its pixels differ (`differing_pixels`). On a difference, test-output/diffs/ gets the shot, the
    snapshot and a picture of the difference (differing pixels red over the dimmed shot). Nothing to compare
    when the shot *is* the snapshot (`make screenshots` writes docs/screenshots)."""
    snapshot = SNAPSHOTS / path.name
    if path.resolve() == snapshot.resolve():
        return
    assert snapshot.is_file(), f"no committed snapshot {snapshot}: run `make screenshots`"
    shot, expected = _pixels(path), _pixels(snapshot)
    diffs = OUTPUT / "diffs"
    if shot.shape != expected.shape:
        share = 1.0
        mask = None
    else:
        mask = differing_pixels(shot, expected)
        share = float(mask.mean())
    if share <= tolerance:
        return
    from PIL import Image

    diffs.mkdir(parents=True, exist_ok=True)
    stem = path.stem
    Image.fromarray(shot.astype(np.uint8)).save(diffs / f"{stem}.actual.png")
    Image.fromarray(expected.astype(np.uint8)).save(diffs / f"{stem}.expected.png")
    if mask is not None:
        picture = (shot // 3).astype(np.uint8)
        picture[mask] = (255, 0, 0)
        Image.fromarray(picture).save(diffs / f"{stem}.diff.png")
    (height, width), (snap_height, snap_width) = shot.shape[:2], expected.shape[:2]
    what = (
        f"{share:.2%} of its pixels differ (tolerance {tolerance:.2%})"
        if mask is not None
        else f"it is {width}×{height} px, the snapshot {snap_width}×{snap_height}"
    )
    raise AssertionError(
        f"{path.name} no longer looks like {snapshot.relative_to(REPO)}: {what}; see {diffs}/{stem}.*.png "
        "(a wanted change: `make screenshots` and commit the pictures)"
    )
