"""Drive the real app in headless Chromium and check that the heatmap shows the routing of the prompt typed.

What the page shows is read from the rendered Vega SVG: every heatmap cell carries an aria-label
"label: POS:TOKEN; expert: E; ...; dispatched: true|false". The expected cells come from the library
(`moeviz.capture` on the same sample model), so the test fails if the chart does not render, shows an
old prompt, the wrong layer, or marks other experts than the model dispatched to.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import numpy as np
import pytest
from playwright.sync_api import Browser, Page

import moeviz
from moeviz.analysis import balance_frame
from moeviz.charts import token_label
from tests.app_server import REPO, AppDidNotStart, running_app

pytestmark = pytest.mark.browser

MODEL = "sample:mixtral-healthy"
NEW_PROMPT = "def add(a, b): return a + b"
# Screenshots of the main views, embedded in the README (MOEVIZ_SCREENSHOTS overrides the folder).
SCREENSHOTS = Path(os.environ.get("MOEVIZ_SCREENSHOTS", REPO / "docs" / "screenshots"))
VIEWPORT = {"width": 1200, "height": 1000}
START_TIMEOUT_S = 90
RENDER_TIMEOUT_S = 60

Cell = tuple[str, int, bool]  # (token label, expert, dispatched)
_CELL = re.compile(
    r"^label: (?P<label>.*?); expert: (?P<expert>\d+); .*dispatched: (?P<dispatched>true|false)$",
    re.DOTALL,  # a token may hold a newline (the tooltip shows it raw)
)
_BAR = re.compile(r"^expert: (?P<expert>\d+); tokens dispatched: (?P<count>\d+);")


def save_screenshot(page: Page, name: str, locator=None) -> None:
    """The visible viewport (or one element) as SCREENSHOTS/name.png: small enough for the README."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    if locator is not None:  # a tall viewport, so the element fits in Streamlit's scrolling main area
        page.set_viewport_size({"width": VIEWPORT["width"], "height": 2200})
        page.wait_for_timeout(500)
        wait_until_idle(page)
        locator.scroll_into_view_if_needed()
        locator.screenshot(path=str(path))
        page.set_viewport_size(VIEWPORT)
    else:
        page.screenshot(path=str(path))


@pytest.fixture(scope="module")
def app_url():
    try:
        with running_app(MODEL, START_TIMEOUT_S) as url:
            yield url
    except AppDidNotStart as exc:
        pytest.fail(str(exc))


@pytest.fixture(scope="module")
def loaded():
    return moeviz.load_model(MODEL)


def expected_cells(loaded, text: str, layer: int) -> set[Cell]:
    """Heatmap cells the page must show for `layer` of `text`, straight from the library."""
    trace = moeviz.capture(loaded, text)
    routing = trace.layer(layer)
    tokens = trace.tokens.iloc[routing.token_rows]
    labels = [token_label(p, t) for p, t in zip(tokens["pos"], tokens["token"], strict=True)]
    rows, slots = np.nonzero(routing.experts >= 0)
    dispatched = {(int(r), int(routing.experts[r, s])) for r, s in zip(rows, slots, strict=True)}
    return {
        (labels[r], e, (r, e) in dispatched) for r in range(len(labels)) for e in range(routing.num_experts)
    }


def expected_load(loaded, text: str, layer: int) -> list[tuple[int, int]]:
    """(expert, tokens dispatched) bars the load chart must show for `layer` of `text`."""
    routing = moeviz.capture(loaded, text).layer(layer)
    counts = np.bincount(routing.experts[routing.experts >= 0], minlength=routing.num_experts)
    return list(enumerate(counts.tolist()))


def _aria_labels(page: Page, selector: str) -> list[str]:
    return page.eval_on_selector_all(selector, "marks => marks.map(m => m.getAttribute('aria-label') || '')")


def shown_cells(page: Page) -> set[Cell]:
    cells = set()
    for text in _aria_labels(page, '.st-key-heatmap [aria-roledescription="rect mark"]'):
        match = _CELL.match(text)
        assert match, f"unexpected heatmap cell label {text!r}"
        cells.add((match["label"], int(match["expert"]), match["dispatched"] == "true"))
    return cells


def shown_load(page: Page) -> list[tuple[int, int]]:
    bars = [_BAR.match(text) for text in _aria_labels(page, '.st-key-load [aria-roledescription="bar"]')]
    return sorted((int(m["expert"]), int(m["count"])) for m in bars if m)


def assert_no_error(page: Page) -> None:
    errors = page.locator('[data-testid="stException"], [data-testid="stAlertContentError"]')
    assert errors.count() == 0, f"the page shows an error:\n{errors.first.inner_text()}"


def wait_for_heading(page: Page, text: str) -> None:
    """Wait until the page's title (h1) contains `text`: the page switched."""
    page.get_by_role("heading", level=1).filter(has_text=text).wait_for(timeout=RENDER_TIMEOUT_S * 1000)


def wait_until_shown(page: Page, read, expected):
    """Poll what the page shows (Streamlit reruns and redraws asynchronously) until it equals `expected`,
    or RENDER_TIMEOUT_S passes; returns what was last shown."""
    deadline = time.monotonic() + RENDER_TIMEOUT_S
    while True:
        assert_no_error(page)
        shown = read(page)
        if shown == expected or time.monotonic() > deadline:
            return shown
        page.wait_for_timeout(250)


def wait_until_idle(page: Page) -> None:
    """Wait until the script run has finished and no element is left stale from the previous run."""
    page.wait_for_function(
        '() => !document.querySelector(\'[data-testid="stStatusWidget"], [data-stale="true"]\')',
        timeout=RENDER_TIMEOUT_S * 1000,
    )


def assert_heatmap_shows(page: Page, expected: set[Cell], what: str) -> None:
    shown = wait_until_shown(page, shown_cells, expected)
    if shown == expected:
        return

    def tokens(cells: set[Cell]) -> list[str]:
        return sorted({label for label, _, _ in cells}, key=lambda label: int(label.split(":")[0]))

    pytest.fail(
        f"heatmap never showed {what} within {RENDER_TIMEOUT_S}s: {len(shown)} cells shown, "
        f"{len(expected)} expected, {len(shown ^ expected)} differ; tokens shown {tokens(shown)}, "
        f"expected {tokens(expected)}"
    )


def test_routing_page_analyses_a_new_prompt(app_url: str, browser: Browser, loaded) -> None:
    page = browser.new_page(viewport=VIEWPORT)
    try:
        page.goto(app_url, wait_until="domcontentloaded")
        prompt = page.locator(".st-key-routing_prompt textarea")
        prompt.wait_for(timeout=RENDER_TIMEOUT_S * 1000)

        # The page opens already analysed: the heatmap shows layer 0 of the example prompt.
        example = prompt.input_value()
        assert example.strip() and example != NEW_PROMPT
        assert_heatmap_shows(page, expected_cells(loaded, example, 0), "layer 0 of the example prompt")

        # A new prompt, submitted with the form's button, replaces it.
        prompt.fill(NEW_PROMPT)
        page.get_by_role("button", name="Analyse").click()
        assert_heatmap_shows(page, expected_cells(loaded, NEW_PROMPT, 0), f"layer 0 of {NEW_PROMPT!r}")
        num_tokens = len(moeviz.capture(loaded, NEW_PROMPT).tokens)
        caption = page.get_by_text(re.compile(r"MixtralForCausalLM · \d+ tokens"))
        assert f"· {num_tokens} tokens ·" in caption.inner_text()

        # The layer slider moves both charts to the next MoE layer, still for the new prompt.
        page.get_by_role("slider", name="MoE layer").press("ArrowRight")
        assert_heatmap_shows(page, expected_cells(loaded, NEW_PROMPT, 1), f"layer 1 of {NEW_PROMPT!r}")
        load = expected_load(loaded, NEW_PROMPT, 1)
        shown = wait_until_shown(page, shown_load, load)
        assert shown == load, f"the load chart shows {shown}, expected {load} (layer 1 of {NEW_PROMPT!r})"
        wait_until_idle(page)
        summary = balance_frame(moeviz.capture(loaded, NEW_PROMPT)).set_index("layer").loc[1]
        max_share = page.locator('[data-testid="stMetric"]', has_text="Max share").inner_text()
        assert f"{summary['max_share']:.0%}" in max_share, max_share
        page.evaluate("window.scrollTo(0, 0)")
        save_screenshot(page, "routing")
    finally:
        page.close()


def test_prompt_from_an_uploaded_file(app_url: str, browser: Browser, loaded, tmp_path) -> None:
    """A text file replaces the prompt (long inputs: pasting them stalls the tab); a file that is not
    UTF-8 gets a message and changes nothing."""
    page = browser.new_page(viewport=VIEWPORT)
    try:
        page.goto(app_url, wait_until="domcontentloaded")
        prompt = page.locator(".st-key-routing_prompt textarea")
        prompt.wait_for(timeout=RENDER_TIMEOUT_S * 1000)
        text = "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n"
        (tmp_path / "prompt.py").write_text(text, encoding="utf-8")
        page.get_by_text("Or a text file").click()
        page.locator('[data-testid="stFileUploaderDropzoneInput"]').set_input_files(tmp_path / "prompt.py")
        page.get_by_text("prompt.py").wait_for(timeout=RENDER_TIMEOUT_S * 1000)
        page.get_by_role("button", name="Analyse").click()
        assert_heatmap_shows(page, expected_cells(loaded, text, 0), "layer 0 of the uploaded file")
        assert prompt.input_value() == text
        wait_until_idle(page)  # the used uploader is replaced by an empty one (a new key) in this run

        (tmp_path / "latin1.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
        if not page.locator('[data-testid="stFileUploaderDropzoneInput"]').is_visible():
            page.get_by_text("Or a text file").click()
        page.locator('[data-testid="stFileUploaderDropzoneInput"]').set_input_files(tmp_path / "latin1.txt")
        page.get_by_text("latin1.txt").wait_for(timeout=RENDER_TIMEOUT_S * 1000)
        page.get_by_role("button", name="Analyse").click()
        error = page.locator('[data-testid="stAlertContentError"]')
        error.wait_for(timeout=RENDER_TIMEOUT_S * 1000)
        assert "latin1.txt is not UTF-8" in error.inner_text()
        assert prompt.input_value() == text  # the prompt on show is still the previous file's
    finally:
        page.close()


PAGES = {  # navigation title -> (screenshot name, key of the container of the page's key chart)
    "Load & collapse": ("load", "load_heatmap"),
    "Structure": ("structure", "coactivation"),
    "Compare": ("compare", "load_shift"),
    "About the model": ("about", None),
}


def _open(browser: Browser, app_url: str) -> Page:
    page = browser.new_page(viewport=VIEWPORT, accept_downloads=True)
    page.goto(app_url, wait_until="domcontentloaded")
    prompt = page.locator(".st-key-routing_prompt textarea")
    prompt.wait_for(timeout=RENDER_TIMEOUT_S * 1000)
    deadline = time.monotonic() + RENDER_TIMEOUT_S  # the example prompt fills it (a loaded CI: not at once)
    while not prompt.input_value() and time.monotonic() < deadline:
        page.wait_for_timeout(250)
    return page


def _marks(page: Page, key: str) -> int:
    return page.locator(f'.st-key-{key} [aria-roledescription="rect mark"]').count()


def test_clicking_a_cell_opens_its_token(app_url: str, browser: Browser, loaded) -> None:
    page = _open(browser, app_url)
    try:
        example = page.locator(".st-key-routing_prompt textarea").input_value()
        assert_heatmap_shows(page, expected_cells(loaded, example, 0), "layer 0 of the example prompt")
        wait_until_idle(page)
        tokens = moeviz.capture(loaded, example).tokens
        label = token_label(int(tokens["pos"].iloc[5]), tokens["token"].iloc[5])
        cell = page.locator(
            f'.st-key-heatmap [aria-roledescription="rect mark"][aria-label^="label: {label}; "]'
        ).first
        cell.scroll_into_view_if_needed()
        cell.click(force=True)
        title = page.locator(".st-key-token_scores")  # its chart title names the token

        def shown() -> str:
            return title.text_content() or ""

        deadline = time.monotonic() + RENDER_TIMEOUT_S
        while f"Scores of '{label}'" not in shown() and time.monotonic() < deadline:
            page.wait_for_timeout(250)
        assert f"Scores of '{label}'" in shown(), f"the drill-down never opened {label!r}"
        wait_until_idle(page)
        assert _marks(page, "token_scores") == len(moeviz.capture(loaded, example).layer_keys) * 8
        save_screenshot(page, "token_drilldown", page.locator(".st-key-drilldown"))
        # "Why this expert?" from the drill-down opens on the same token.
        page.get_by_role("link", name="Why this expert? Attribution").click()
        wait_for_heading(page, "Why this expert")
        page.get_by_role("button", name="Explain").click()
        position = int(tokens["pos"].iloc[5])
        page.get_by_text(f"position {position}", exact=False).first.wait_for(timeout=RENDER_TIMEOUT_S * 1000)
    finally:
        page.close()


def test_pages_render_and_a_csv_download_matches_the_library(app_url: str, browser: Browser, loaded) -> None:
    import io

    import pandas as pd

    from moeviz.analysis import expert_balance_frame

    page = _open(browser, app_url)
    try:
        example = page.locator(".st-key-routing_prompt textarea").input_value()
        trace = moeviz.capture(loaded, example)
        for title, (name, key) in PAGES.items():
            page.get_by_role("link", name=title).click()
            wait_for_heading(page, title.split(" ")[0])
            if key is not None:
                page.locator(f'.st-key-{key} [aria-roledescription$="mark"]').first.wait_for(
                    timeout=RENDER_TIMEOUT_S * 1000
                )
            wait_until_idle(page)
            assert_no_error(page)
            if name == "load":
                assert _marks(page, "load_heatmap") == len(trace.layer_keys) * 8
                with page.expect_download() as download:
                    page.get_by_role("button", name="expert_load.csv").click()
                shown = pd.read_csv(io.BytesIO(Path(download.value.path()).read_bytes()))
                expected = expert_balance_frame(trace)
                pd.testing.assert_frame_equal(shown, expected.reset_index(drop=True), check_dtype=False)
            page.evaluate("window.scrollTo(0, 0)")
            save_screenshot(page, name)
    finally:
        page.close()


SESSION_PROMPTS = [
    "Mixture-of-experts models route every token to a few experts.",
    "def mean(xs): return sum(xs) / len(xs)",
    "La tour Eiffel est le monument le plus visité de Paris.",
    "SELECT name, count(*) FROM users GROUP BY name;",
    "The mitochondria is the powerhouse of the cell, they said.",
    "for i in range(10):\n    print(i * i)",
    "2 + 2 = 4, and 3 * 7 = 21; primes: 2, 3, 5, 7, 11.",
    "Once upon a time, a small fox lived at the edge of a forest.",
]


def test_eight_concurrent_sessions_each_see_their_own_prompt(app_url: str, browser: Browser, loaded) -> None:
    """Eight browser contexts (separate sessions, one Chromium) submit eight prompts at once; each heatmap
    must show exactly its own prompt's routing, token by token, as the library computes it."""
    contexts = [browser.new_context(viewport=VIEWPORT) for _ in SESSION_PROMPTS]
    try:
        pages = [context.new_page() for context in contexts]
        for page in pages:
            page.goto(app_url, wait_until="domcontentloaded")
        for page, text in zip(pages, SESSION_PROMPTS, strict=True):
            prompt = page.locator(".st-key-routing_prompt textarea")
            prompt.wait_for(timeout=RENDER_TIMEOUT_S * 1000)
            prompt.fill(text)
        for page in pages:  # submit all before looking at any: the server handles them together
            page.get_by_role("button", name="Analyse").click()
        for page, text in zip(pages, SESSION_PROMPTS, strict=True):
            assert_heatmap_shows(page, expected_cells(loaded, text, 0), f"layer 0 of {text!r}")
            wait_until_idle(page)
            num_tokens = len(moeviz.capture(loaded, text).tokens)
            caption = page.get_by_text(re.compile(r"MixtralForCausalLM · \d+ tokens"))
            assert f"· {num_tokens} tokens ·" in caption.inner_text(), (text, caption.inner_text())
            assert page.locator(".st-key-routing_prompt textarea").input_value() == text
    finally:
        for context in contexts:
            context.close()


_HEAD_CELL = re.compile(r"^head: (?P<head>\d+); layer: (?P<layer>\d+);")


def test_attention_page_shows_the_head_grid_and_a_clicked_head(
    app_url: str, browser: Browser, loaded
) -> None:
    page = _open(browser, app_url)
    try:
        example = page.locator(".st-key-routing_prompt textarea").input_value()
        att = moeviz.capture(loaded, example, attention=True).attention
        page.get_by_role("link", name="Attention").click()
        wait_for_heading(page, "Attention")
        grid = '.st-key-heads_mean_entropy [aria-roledescription="rect mark"]'
        expected = sorted((layer, head) for layer in att.map_layers for head in range(4))

        def shown_heads(page: Page) -> list[tuple[int, int]]:
            cells = [_HEAD_CELL.match(text) for text in _aria_labels(page, grid)]
            return sorted((int(m["layer"]), int(m["head"])) for m in cells if m)

        assert wait_until_shown(page, shown_heads, expected) == expected
        wait_until_idle(page)
        num_tokens = len(att.lengths) and int(att.lengths[0])
        assert _marks(page, "attention_map") == num_tokens * num_tokens

        # clicking a head of the grid opens its map
        cell = page.locator(f'{grid}[aria-label^="head: 1; layer: 2;"]').first
        cell.scroll_into_view_if_needed()
        cell.click(force=True)
        title = page.locator(".st-key-attention_map")
        deadline = time.monotonic() + RENDER_TIMEOUT_S
        while "Layer 2, head 1" not in (title.text_content() or "") and time.monotonic() < deadline:
            page.wait_for_timeout(250)
        assert "Layer 2, head 1" in (title.text_content() or ""), "clicking a head did not open its map"
        wait_until_idle(page)
        assert_no_error(page)
        page.locator(".st-key-heads_mean_entropy").scroll_into_view_if_needed()
        save_screenshot(page, "attention")
        save_screenshot(page, "attention_map", page.locator(".st-key-attention_map"))
    finally:
        page.close()


def test_why_page_runs_a_what_if_and_an_attribution(app_url: str, browser: Browser, loaded) -> None:
    """Both "Why this expert?" controls work in the browser: the what-if reports a log-prob and the
    predicted next token; Explain draws the attribution strip over the prompt's tokens."""
    page = _open(browser, app_url)
    try:
        example = page.locator(".st-key-routing_prompt textarea").input_value()
        page.get_by_role("link", name="Why this expert?", exact=True).click()
        wait_for_heading(page, "Why this expert")
        page.get_by_role("button", name="Run what-if").click()
        page.get_by_text("Predicted next token").wait_for(timeout=RENDER_TIMEOUT_S * 1000)
        label = page.get_by_text("after the prompt").first.text_content() or ""
        expected_next = moeviz.capture(loaded, example).tokens["predicted_id"].iloc[-1]
        assert (
            repr(loaded.tokenizer.decode([int(expected_next)])) in label
        )  # log p(next token) of this prompt
        page.get_by_role("button", name="Explain").click()
        page.get_by_text("IG convergence delta").wait_for(timeout=RENDER_TIMEOUT_S * 1000)
        strip = page.locator('[aria-roledescription="rect mark"], [aria-roledescription="text mark"]')
        strip.first.wait_for(timeout=RENDER_TIMEOUT_S * 1000)
        wait_until_idle(page)
        save_screenshot(page, "why")
    finally:
        page.close()
