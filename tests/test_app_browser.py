"""Drive the real app in headless Chromium and check that the heatmap shows the routing of the prompt typed.

What the page shows is read from the rendered Vega SVG: every heatmap cell carries an aria-label
"label: POS:TOKEN; expert: E; ...; dispatched: true|false". The expected cells come from the library
(`moeviz.capture` on the same sample model), so the test fails if the chart does not render, shows an
old prompt, the wrong layer, or marks other experts than the model dispatched to.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from playwright.sync_api import Browser, Page, sync_playwright

import moeviz
from moeviz.analysis import layer_summary_frame
from moeviz.charts import token_label

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
MODEL = "sample:mixtral-healthy"
NEW_PROMPT = "def add(a, b): return a + b"
SCREENSHOT = Path("/tmp/moeviz_app.png")
START_TIMEOUT_S = 90
RENDER_TIMEOUT_S = 60

Cell = tuple[str, int, bool]  # (token label, expert, dispatched)
_CELL = re.compile(
    r"^label: (?P<label>.*); expert: (?P<expert>\d+); .*dispatched: (?P<dispatched>true|false)$"
)
_BAR = re.compile(r"^expert: (?P<expert>\d+); tokens dispatched: (?P<count>\d+);")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def app_url():
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MOEVIZ_DEFAULT_MODEL": MODEL}
    env.pop("MOEVIZ_MODEL_DIRS", None)
    command = [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        "app/streamlit_app.py",
        "--server.headless",
        "true",
        "--server.port",
        str(port),
        "--server.address",
        "127.0.0.1",
        "--server.fileWatcherType",
        "none",
        "--browser.gatherUsageStats",
        "false",
    ]
    with tempfile.TemporaryFile(mode="w+") as log:
        server = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_healthy(url, server, log)
            yield url
        finally:
            server.terminate()
            try:
                server.wait(timeout=15)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def _wait_healthy(url: str, server: subprocess.Popen, log) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            log.seek(0)
            pytest.fail(
                f"streamlit exited with {server.returncode} before it was healthy:\n{log.read()[-4000:]}"
            )
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as response:
                if response.status == 200 and response.read().strip() == b"ok":
                    return
        except OSError:
            pass
        time.sleep(0.3)
    log.seek(0)
    pytest.fail(f"streamlit not healthy after {START_TIMEOUT_S}s:\n{log.read()[-4000:]}")


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.is_file():
        pytest.fail(
            f"{CHROMIUM} not found: the browser test needs Debian's chromium (apt-get install chromium)"
        )
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        try:
            yield chromium
        finally:
            chromium.close()


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


def wait_until_shown(page: Page, read, expected):
    """Poll what the page shows (Streamlit reruns and redraws asynchronously) until it equals `expected`,
    or RENDER_TIMEOUT_S passes; returns what was last shown."""
    deadline = time.monotonic() + RENDER_TIMEOUT_S
    while True:
        errors = page.locator('[data-testid="stException"], [data-testid="stAlertContentError"]')
        assert errors.count() == 0, f"the page shows an error:\n{errors.first.inner_text()}"
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
    page = browser.new_page(viewport={"width": 1400, "height": 1700})
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
        summary = layer_summary_frame(moeviz.capture(loaded, NEW_PROMPT)).set_index("layer").loc[1]
        max_share = page.locator('[data-testid="stMetric"]', has_text="Max share").inner_text()
        assert f"{summary['max_share']:.0%}" in max_share, max_share
        page.screenshot(path=str(SCREENSHOT), full_page=True)
    finally:
        page.close()


PAGES = {  # navigation title -> (screenshot name, key of the container of the page's key chart)
    "Load & collapse": ("load", "load_heatmap"),
    "Structure": ("structure", "coactivation"),
    "Compare": ("compare", "load_shift"),
    "About the model": ("about", None),
}


def _open(browser: Browser, app_url: str) -> Page:
    page = browser.new_page(viewport={"width": 1400, "height": 1700}, accept_downloads=True)
    page.goto(app_url, wait_until="domcontentloaded")
    page.locator(".st-key-routing_prompt textarea").wait_for(timeout=RENDER_TIMEOUT_S * 1000)
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
        page.screenshot(path="/tmp/moeviz_routing.png", full_page=True)
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
            page.get_by_role("heading", level=1).filter(has_text=title.split(" ")[0]).wait_for(
                timeout=RENDER_TIMEOUT_S * 1000
            )
            if key is not None:
                page.locator(f'.st-key-{key} [aria-roledescription$="mark"]').first.wait_for(
                    timeout=RENDER_TIMEOUT_S * 1000
                )
            wait_until_idle(page)
            errors = page.locator('[data-testid="stException"], [data-testid="stAlertContentError"]')
            assert errors.count() == 0, errors.first.inner_text()
            if name == "load":
                assert _marks(page, "load_heatmap") == len(trace.layer_keys) * 8
                with page.expect_download() as download:
                    page.get_by_role("button", name="expert_load.csv").click()
                shown = pd.read_csv(io.BytesIO(Path(download.value.path()).read_bytes()))
                expected = expert_balance_frame(trace)
                pd.testing.assert_frame_equal(shown, expected.reset_index(drop=True), check_dtype=False)
            page.screenshot(path=f"/tmp/moeviz_{name}.png", full_page=True)
    finally:
        page.close()
