"""Drive the real app in headless Chromium and check that the heatmap shows the routing of the prompt typed.

What the page shows is read from the rendered Vega SVG: every heatmap cell carries an aria-label
"label: POS:TOKEN; expert: E; ...; dispatched: true|false". The expected cells come from the library
(`moeviz.capture` on the same sample model), so the test fails if the chart does not render, shows an
old prompt, the wrong layer, or marks other experts than the model dispatched to.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from playwright.sync_api import Browser, Page, expect

import moeviz
from moeviz.analysis import balance_frame, expert_balance_frame, layer_coactivation_frame
from moeviz.charts import token_label
from tests.support.browser import (
    MODEL,
    RENDER_TIMEOUT_S,
    VIEWPORT,
    after_run,
    aria_fields,
    aria_labels,
    assert_no_error,
    charts_drawn,
    marks,
    open_app,
    open_page,
    prompt_file_input,
    save_screenshot,
    wait_until_idle,
    wait_until_shown,
    watch,
)

NEW_PROMPT = "def add(a, b): return a + b"

Cell = tuple[str, int, bool]  # (token label, expert, dispatched)
_CELL = re.compile(
    r"^label: (?P<label>.*?); expert: (?P<expert>\d+); .*dispatched: (?P<dispatched>true|false)$",
    re.DOTALL,  # a token may hold a newline (the tooltip shows it raw)
)
_BAR = re.compile(r"^expert: (?P<expert>\d+); tokens dispatched: (?P<count>\d+);")


@pytest.fixture
def url(app_url) -> str:
    return app_url(MODEL)


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


def shown_cells(page: Page) -> set[Cell]:
    cells = set()
    for text in aria_labels(page, '.st-key-heatmap [aria-roledescription="rect mark"]'):
        match = _CELL.match(text)
        assert match, f"unexpected heatmap cell label {text!r}"
        cells.add((match["label"], int(match["expert"]), match["dispatched"] == "true"))
    return cells


def shown_load(page: Page) -> list[tuple[int, int]]:
    bars = [_BAR.match(text) for text in aria_labels(page, '.st-key-load [aria-roledescription="bar"]')]
    return sorted((int(m["expert"]), int(m["count"])) for m in bars if m)


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


def example_prompt(page: Page) -> str:
    return page.locator(".st-key-routing_prompt textarea").input_value()


def test_routing_page_analyses_a_new_prompt(url: str, browser: Browser, sample_model) -> None:
    page = open_app(browser, url)
    try:
        prompt = page.locator(".st-key-routing_prompt textarea")
        # The page opens already analysed: the heatmap shows layer 0 of the example prompt.
        example = prompt.input_value()
        assert example.strip() and example != NEW_PROMPT
        assert_heatmap_shows(page, expected_cells(sample_model, example, 0), "layer 0 of the example prompt")

        # A new prompt, submitted with the form's button, replaces it.
        prompt.fill(NEW_PROMPT)
        after_run(page, page.get_by_role("button", name="Analyse").click)
        assert_heatmap_shows(page, expected_cells(sample_model, NEW_PROMPT, 0), f"layer 0 of {NEW_PROMPT!r}")
        num_tokens = len(moeviz.capture(sample_model, NEW_PROMPT).tokens)
        caption = page.get_by_text(re.compile(r"MixtralForCausalLM · \d+ tokens"))
        assert f"· {num_tokens} tokens ·" in caption.inner_text()

        # The layer slider moves both charts to the next MoE layer, still for the new prompt.
        after_run(page, lambda: page.get_by_role("slider", name="MoE layer").press("ArrowRight"))
        assert_heatmap_shows(page, expected_cells(sample_model, NEW_PROMPT, 1), f"layer 1 of {NEW_PROMPT!r}")
        load = expected_load(sample_model, NEW_PROMPT, 1)
        shown = wait_until_shown(page, shown_load, load)
        assert shown == load, f"the load chart shows {shown}, expected {load} (layer 1 of {NEW_PROMPT!r})"
        wait_until_idle(page)
        summary = balance_frame(moeviz.capture(sample_model, NEW_PROMPT)).set_index("layer").loc[1]
        max_share = page.locator('[data-testid="stMetric"]', has_text="Max share").inner_text()
        assert f"{summary['max_share']:.0%}" in max_share, max_share
        page.evaluate("window.scrollTo(0, 0)")
        save_screenshot(page, "routing")
    finally:
        page.close()


def test_prompt_from_an_uploaded_file(url: str, browser: Browser, sample_model, tmp_path) -> None:
    """A text file replaces the prompt (long inputs: pasting them stalls the tab); a file that is not
    UTF-8 gets a message and changes nothing."""
    page = open_app(browser, url)
    try:
        prompt = page.locator(".st-key-routing_prompt textarea")
        text = "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n"
        (tmp_path / "prompt.py").write_text(text, encoding="utf-8")
        prompt_file_input(page).set_input_files(tmp_path / "prompt.py")  # in the form: no run until Analyse
        page.get_by_text("prompt.py").wait_for(timeout=RENDER_TIMEOUT_S * 1000)
        after_run(page, page.get_by_role("button", name="Analyse").click)
        assert_heatmap_shows(page, expected_cells(sample_model, text, 0), "layer 0 of the uploaded file")
        assert prompt.input_value() == text
        wait_until_idle(page)  # the used uploader is replaced by an empty one (a new key) in this run

        (tmp_path / "latin1.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
        prompt_file_input(page).set_input_files(tmp_path / "latin1.txt")  # a new (empty) uploader
        page.get_by_text("latin1.txt").wait_for(timeout=RENDER_TIMEOUT_S * 1000)
        after_run(page, page.get_by_role("button", name="Analyse").click)
        error = page.locator('[data-testid="stAlertContentError"]')
        error.wait_for(timeout=RENDER_TIMEOUT_S * 1000)
        assert "latin1.txt is not UTF-8" in error.inner_text()
        assert prompt.input_value() == text  # the prompt on show is still the previous file's
    finally:
        page.close()


def test_clicking_a_cell_opens_its_token(url: str, browser: Browser, sample_model) -> None:
    page = open_app(browser, url)
    try:
        example = example_prompt(page)
        assert_heatmap_shows(page, expected_cells(sample_model, example, 0), "layer 0 of the example prompt")
        wait_until_idle(page)
        trace = moeviz.capture(sample_model, example)
        tokens = trace.tokens
        label = token_label(int(tokens["pos"].iloc[5]), tokens["token"].iloc[5])
        cell = page.locator(
            f'.st-key-heatmap [aria-roledescription="rect mark"][aria-label^="label: {label}; "]'
        ).first
        cell.scroll_into_view_if_needed()
        after_run(page, lambda: cell.click(force=True))
        title = page.locator(".st-key-token_scores")  # its chart title names the token
        expect(title, "the drill-down never opened the token").to_contain_text(
            f"Scores of '{label}'", timeout=RENDER_TIMEOUT_S * 1000
        )
        wait_until_idle(page)
        charts_drawn(page)
        assert marks(page, "token_scores") == len(trace.layer_keys) * 8
        save_screenshot(page, "token_drilldown", page.locator(".st-key-drilldown"))
        # "Why this expert?" from the drill-down opens on the same token.
        page.get_by_role("link", name="Why this expert? Attribution").click()
        page.get_by_role("heading", level=1).filter(has_text="Why this expert").wait_for(
            timeout=RENDER_TIMEOUT_S * 1000
        )
        wait_until_idle(page)
        after_run(page, page.get_by_role("button", name="Explain").click)
        position = int(tokens["pos"].iloc[5])
        page.get_by_text(f"position {position}", exact=False).first.wait_for(timeout=RENDER_TIMEOUT_S * 1000)
    finally:
        page.close()


PAGES = {  # navigation title -> (screenshot name, key of the container of the page's key chart)
    "Load & collapse": ("load", "load_heatmap"),
    "Structure": ("structure", "coactivation"),
    "Compare": ("compare", "load_shift"),
    "About the model": ("about", None),
}


COMPARED_WITH = "sample:mixtral-unbalanced"  # the Compare page's default model B


def mark_fields(page: Page, key: str) -> list[dict[str, str]]:
    """The tooltip fields of every rect mark of the chart in the container `key`."""
    return [aria_fields(a) for a in aria_labels(page, f'.st-key-{key} [aria-roledescription="rect mark"]')]


def metrics(page: Page) -> dict[str, str]:
    """label → value of every metric on the page."""
    texts = page.eval_on_selector_all('[data-testid="stMetric"]', "els => els.map(e => e.innerText)")
    return {lines[0]: lines[1] for lines in ([x for x in t.split("\n") if x.strip()] for t in texts)}


def test_pages_show_the_librarys_numbers_and_a_csv_download_matches(
    url: str, browser: Browser, sample_model
) -> None:
    """Load & collapse (every cell, and its CSV download), Structure (co-activation of layer 0), Compare
    (the load shift against the default model B) and About show what the library computes."""
    page = open_app(browser, url, accept_downloads=True)
    try:
        example = example_prompt(page)
        trace = moeviz.capture(sample_model, example)
        for title, (name, key) in PAGES.items():
            open_page(page, title, title.split(" ")[0])
            if key is not None:
                page.locator(f'.st-key-{key} [aria-roledescription$="mark"]').first.wait_for(
                    timeout=RENDER_TIMEOUT_S * 1000
                )
            charts_drawn(page)
            assert_no_error(page)
            if name == "load":
                assert marks(page, "load_heatmap") == len(trace.layer_keys) * 8
                with page.expect_download() as download:
                    page.get_by_role("button", name="expert_load.csv").click()
                shown = pd.read_csv(io.BytesIO(Path(download.value.path()).read_bytes()))
                expected = expert_balance_frame(trace)
                pd.testing.assert_frame_equal(shown, expected.reset_index(drop=True), check_dtype=False)
            if name == "structure":  # P(j | i) of layer 0, the diagonal left out
                expected = {
                    (r.expert, r.co_expert, r.pair_count, r.expert_count)
                    for r in layer_coactivation_frame(trace, 0, "mlp").itertuples()
                    if r.expert != r.co_expert
                }
                cells = {
                    (int(f["i"]), int(f["j"]), int(f["tokens with both"]), int(f["tokens with i"]))
                    for f in mark_fields(page, "coactivation")
                }
                assert cells == expected
            if name == "compare":  # every layer × expert: the tokens A and B send there
                other = moeviz.capture(moeviz.load_model(COMPARED_WITH), example)
                counts = {
                    (r.layer, r.expert, side): r.count
                    for side, routed in (("A", trace), ("B", other))
                    for r in expert_balance_frame(routed).itertuples()
                }
                fields = mark_fields(page, "load_shift")
                shown = {(int(f["layer"]), int(f["expert"])): f for f in fields}
                assert len(shown) == len(fields) == len(trace.layer_keys) * 8
                for (layer, expert), f in shown.items():
                    assert int(f["tokens in A"]) == counts[(layer, expert, "A")], (layer, expert)
                    assert int(f["tokens in B"]) == counts[(layer, expert, "B")], (layer, expert)
            if name == "about":  # what the library loaded
                shown = metrics(page)
                assert shown["Parameters"] == f"{sum(p.numel() for p in sample_model.model.parameters()):,}"
                assert shown["MoE layers"] == str(len(trace.layer_keys))
                assert shown["Routed experts"] == str(trace.layers[0].num_experts)
                assert shown["Top-k"] == str(trace.layers[0].k)
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


def test_eight_concurrent_sessions_each_see_their_own_prompt(
    url: str, browser: Browser, sample_model
) -> None:
    """Eight browser contexts (separate sessions, one Chromium, one server) submit eight prompts at once;
    each heatmap must show exactly its own prompt's routing, token by token, as the library computes it."""
    contexts = [browser.new_context(viewport=VIEWPORT) for _ in SESSION_PROMPTS]
    try:
        pages = [watch(context.new_page()) for context in contexts]
        for page in pages:
            page.goto(url, wait_until="domcontentloaded")
        for page, text in zip(pages, SESSION_PROMPTS, strict=True):
            prompt = page.locator(".st-key-routing_prompt textarea")
            prompt.wait_for(timeout=RENDER_TIMEOUT_S * 1000)
            prompt.fill(text)
        for page in pages:  # submit all before looking at any: the server handles them together
            page.get_by_role("button", name="Analyse").click()
        for page, text in zip(pages, SESSION_PROMPTS, strict=True):
            assert_heatmap_shows(page, expected_cells(sample_model, text, 0), f"layer 0 of {text!r}")
            wait_until_idle(page)
            num_tokens = len(moeviz.capture(sample_model, text).tokens)
            caption = page.get_by_text(re.compile(r"MixtralForCausalLM · \d+ tokens"))
            assert f"· {num_tokens} tokens ·" in caption.inner_text(), (text, caption.inner_text())
            assert page.locator(".st-key-routing_prompt textarea").input_value() == text
    finally:
        for context in contexts:
            context.close()


_HEAD_CELL = re.compile(r"^head: (?P<head>\d+); layer: (?P<layer>\d+);")


def test_attention_page_shows_the_head_grid_and_a_clicked_head(
    url: str, browser: Browser, sample_model
) -> None:
    page = open_app(browser, url)
    try:
        example = example_prompt(page)
        att = moeviz.capture(sample_model, example, attention=True).attention
        open_page(page, "Attention")
        grid = '.st-key-heads_mean_entropy [aria-roledescription="rect mark"]'
        expected = sorted((layer, head) for layer in att.map_layers for head in range(4))

        def shown_heads(page: Page) -> list[tuple[int, int]]:
            cells = [_HEAD_CELL.match(text) for text in aria_labels(page, grid)]
            return sorted((int(m["layer"]), int(m["head"])) for m in cells if m)

        assert wait_until_shown(page, shown_heads, expected) == expected
        wait_until_idle(page)
        charts_drawn(page)
        num_tokens = len(att.lengths) and int(att.lengths[0])
        assert marks(page, "attention_map") == num_tokens * num_tokens

        # clicking a head of the grid opens its map
        cell = page.locator(f'{grid}[aria-label^="head: 1; layer: 2;"]').first
        cell.scroll_into_view_if_needed()
        after_run(page, lambda: cell.click(force=True))
        expect(page.locator(".st-key-attention_map"), "clicking a head did not open its map").to_contain_text(
            "Layer 2, head 1", timeout=RENDER_TIMEOUT_S * 1000
        )
        wait_until_idle(page)
        assert_no_error(page)
        page.locator(".st-key-heads_mean_entropy").scroll_into_view_if_needed()
        save_screenshot(page, "attention")
        save_screenshot(page, "attention_map", page.locator(".st-key-attention_map"))
    finally:
        page.close()


def test_why_page_runs_a_what_if_and_an_attribution(url: str, browser: Browser, sample_model) -> None:
    """Both "Why this expert?" controls work in the browser: the what-if reports a log-prob and the
    predicted next token; Explain draws the attribution strip over the prompt's tokens."""
    page = open_app(browser, url)
    try:
        example = example_prompt(page)
        open_page(page, "Why this expert?", "Why this expert")
        after_run(page, page.get_by_role("button", name="Run what-if").click)
        page.get_by_text("Predicted next token").wait_for(timeout=RENDER_TIMEOUT_S * 1000)
        label = page.get_by_text("after the prompt").first.text_content() or ""
        expected_next = moeviz.capture(sample_model, example).tokens["predicted_id"].iloc[-1]
        assert repr(sample_model.tokenizer.decode([int(expected_next)])) in label  # log p(next token)
        after_run(page, page.get_by_role("button", name="Explain").click)
        page.get_by_text("IG convergence delta").wait_for(timeout=RENDER_TIMEOUT_S * 1000)
        strip = '.st-key-why_ig [aria-roledescription="rect mark"]'
        page.locator(strip).first.wait_for(timeout=RENDER_TIMEOUT_S * 1000)
        wait_until_idle(page)
        charts_drawn(page)
        # the strip: one cell per token of the prompt up to the explained one (the token picker's)
        tokens = moeviz.capture(sample_model, example).tokens
        labels = [token_label(int(p), t) for p, t in zip(tokens["pos"], tokens["token"], strict=True)]
        pos = int(page.locator(".st-key-token_widget input").input_value().split(":")[0])
        assert [aria_fields(a)["label"] for a in aria_labels(page, strip)] == labels[: pos + 1]
        save_screenshot(page, "why")
    finally:
        page.close()
