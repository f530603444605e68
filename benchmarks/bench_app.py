"""App latency in the real browser: `python benchmarks/bench_app.py` prints the figures.

Starts `streamlit run app/serve.py` on the default sample (mixtral-healthy) and drives it with
Playwright in headless Debian Chromium (the flags of tests/browser/test_app_browser.py). Measured, each from
the user's input (the timestamp of the first pointer or key press the action dispatches in the page, not
Playwright's own checks before it) to the first animation frame in which the browser has drawn the result:

1. submit a new 1,000-token prompt → heatmap rendered with its tokens (target < 3 s; a fresh prompt each
   repetition, so every run includes the model forward);
2. switch MoE layer with the slider → heatmap of the new layer rendered (target < 0.5 s; no model run);
3. click a heatmap cell → the token's drill-down rendered (no model run);
4. a prompt of the model's whole context (the sample: 32,768 tokens, sliding-window attention), uploaded
   as a text file → binned overview and windowed heatmap rendered (this includes the model forward: the
   cost of the model itself), a layer switch and a token click at that length, and the Attention page's
   head grid and map; meanwhile a heartbeat timer in the tab records the longest gap between its ticks (a
   stalled tab shows up as a long gap) and Chromium's long tasks.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from playwright.sync_api import Page, sync_playwright
from record import Figure, record

import moeviz
from moeviz.capture.forward import token_batch
from moeviz.samples import eval_batch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the launcher lives with the tests
from tests.support.server import CHROMIUM, CHROMIUM_ARGS, running_app

MODEL = "sample:mixtral-healthy"
# nothing kept between servers (`moeviz.trace.kept`): each server loads the model; bench_startup measures
# the first page with the example kept
os.environ["MOEVIZ_CACHE_DIR"] = ""
TIMEOUT_MS = 300_000  # the 32k-token forward alone takes about a minute here
REPEATS = 3
HEATMAP_CELLS = '.st-key-heatmap [aria-roledescription="rect mark"]'
SECTION, COMMAND = "The app in a browser", "python benchmarks/bench_app.py"

# Resolves when `check()` (a JS expression) holds and nothing visible on the page is stale; polled every
# frame. An empty placeholder is not seen: Streamlit keeps the main script's `st.empty` (the progress bar's)
# marked stale while a fragment runs, to its end, though nothing shows faded. (A selector, not a size read:
# that would force a layout in every frame of the very main thread it times.)
_WAIT_JS = """([check, timeout]) => new Promise((resolve, reject) => {
  const ok = new Function('return (' + check + ')');
  const start = performance.now();
  const tick = () => {
    if (performance.now() - start < 30) { requestAnimationFrame(tick); return; }  // let the action land
    const stale = document.querySelector(
      '[data-stale="true"]:not(:has(> [data-testid="stEmpty"]:only-child))');
    if (ok() && !stale) resolve(performance.now());
    else if (performance.now() - start > timeout) reject(new Error('timed out waiting for ' + check +
      (stale ? ' (stale elements left)' : '')));
    else requestAnimationFrame(tick);
  };
  tick();
})"""
_HEARTBEAT_JS = """() => {
  window.__gaps = []; let last = performance.now();
  window.__beat = setInterval(() => { const now = performance.now(); window.__gaps.push(now - last);
    last = now; }, 20);
  window.__long = [];
  try { new PerformanceObserver(l => l.getEntries().forEach(e => window.__long.push(e.duration)))
          .observe({type: 'longtask', buffered: false}); } catch (e) {}
}"""


# Counts each canvas's renders: Vega's canvas renderer clears its canvas once at the start of every render
# (vega-scenegraph CanvasRenderer.clear), so the watcher below reads a canvas's pixels only in the frames
# after it was drawn, not every frame (a pixel read on every frame and chart took tens of ms of the very
# main thread it measures). Installed in the page before the app's own scripts.
INIT_JS = """(() => {
  const clear = CanvasRenderingContext2D.prototype.clearRect;
  CanvasRenderingContext2D.prototype.clearRect = function (...args) {
    (window.__cleared || (window.__cleared = new Set())).add(this.canvas);
    return clear.apply(this, args);
  };
})()"""
# A chart's signature: its canvas scaled down to 48 × 48 pixels and hashed (about a millisecond), or its
# SVG's element count and text hashed.
SIG_JS = """(node) => {
  if (!node) return '';
  if (node.tagName !== 'CANVAS') {
    const t = node.textContent; let h = node.querySelectorAll('*').length;  // markup: too costly every frame
    for (let i = 0; i < t.length; i++) h = (h * 31 + t.charCodeAt(i)) | 0;
    return 'svg' + t.length + ':' + h;
  }
  const o = window.__sig || (window.__sig = document.createElement('canvas'));
  o.width = 48; o.height = 48;
  const x = o.getContext('2d');
  x.drawImage(node, 0, 0, 48, 48);
  const d = x.getImageData(0, 0, 48, 48).data;
  let h = 0;
  for (let i = 0; i < d.length; i++) h = (h * 31 + d[i]) | 0;
  return node.width + 'x' + node.height + ':' + h;
}"""
# Every frame: each chart's signature where it may have changed (a new node, a canvas drawn since, an SVG);
# the time it last changed since the mark in __changed. __input: the time of the user's input (the first
# pointer press or key press after the mark, its event's timestamp), where each interaction is measured
# from: Playwright's own work before it presses (finding the element, waiting for it to stand still) is not
# the user's action.
WATCH_JS = f"""(keys) => {{
  const sig = {SIG_JS};
  window.__input = null;
  if (!window.__inputHooked) {{
    const first = (e) => {{ if (window.__input === null) window.__input = e.timeStamp; }};
    for (const type of ['pointerdown', 'keydown']) document.addEventListener(type, first, true);
    window.__inputHooked = true;
  }}
  const find = (k) => document.querySelector('.st-key-' + k + ' canvas, .st-key-' + k + ' svg.marks');
  window.__cleared = new Set();
  window.__changed = {{}};
  const nodes = {{}}, prev = {{}};
  for (const k of keys) {{ nodes[k] = find(k); prev[k] = sig(nodes[k]); }}
  window.__watching = true;
  const tick = () => {{
    const cleared = window.__cleared;
    for (const k of keys) {{
      let node = nodes[k];
      if (node && node.isConnected && node.tagName === 'CANVAS' && !cleared.has(node)) continue;
      node = nodes[k] = find(k);
      const s = sig(node);
      if (s !== prev[k]) {{ prev[k] = s; window.__changed[k] = performance.now(); }}
    }}
    cleared.clear();
    window.__lastChange = Math.max(0, ...Object.values(window.__changed));
    if (window.__watching) requestAnimationFrame(tick);
  }};
  tick();
}}"""
# The heatmap drew something else than it showed at the mark (what the watcher saw in the last frame).
HEATMAP_CHANGED = "(window.__changed.heatmap !== undefined)"


def caption_says(num_tokens: int) -> str:
    """JS: the page caption gives the prompt's token count."""
    return (
        "[...document.querySelectorAll('[data-testid=\"stCaptionContainer\"]')]"
        f".some(c => c.textContent.includes('· {num_tokens} tokens ·'))"
    )


SETTLE_MS = 1000  # a pause before each action, as a person takes: views still drawing finish first


def timed(page: Page, action, check: str) -> float:
    """Seconds from the user's input in `action()` (its first pointer or key press in the page; the call
    itself where it dispatches none) to the first frame in which `check` holds (browser clock); the page
    gets SETTLE_MS to finish what the previous action started. The page needs INIT_JS (`new_page`)."""
    page.wait_for_timeout(SETTLE_MS)
    page.evaluate(WATCH_JS, ["heatmap"])
    called = page.evaluate("() => performance.now()")
    action()
    end = page.evaluate(_WAIT_JS, [check, TIMEOUT_MS])
    pressed = page.evaluate("() => { window.__watching = false; return window.__input; }")
    return (end - (called if pressed is None else pressed)) / 1000


def new_page(browser) -> Page:
    """A page of the app's size with INIT_JS installed (what `timed` reads)."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.add_init_script(INIT_JS)
    return page


def prompts(loaded, length: int, count: int) -> list[str]:
    """`count` different texts of exactly `length` tokens, from the sample's evaluation corpus (repeated
    when `length` exceeds it)."""
    ids = [i for window in eval_batch(loaded).token_ids for i in window]
    ids = ids * (2 * length // len(ids) + 2)
    texts = []
    for k in range(count):
        start = (k * 997) % max(len(ids) - length * 2, 1)
        n = length
        while True:  # decoding and re-tokenizing may merge tokens: grow until the text has `length`
            text = loaded.tokenizer.decode(ids[start : start + n])
            got = len(token_batch(loaded, [text], None)[0])
            if got >= length:
                break
            n += max(1, length - got)
        while got > length:  # and trim back to exactly `length`
            text = text[: len(text) - max(1, (got - length))]
            got = len(token_batch(loaded, [text], None)[0])
        texts.append(text)
    return texts


def submit(page: Page, text: str):
    def act() -> None:
        box = page.locator(".st-key-routing_prompt textarea")
        box.fill(text)
        page.get_by_role("button", name="Analyse").click()

    return act


def upload(page: Page, text: str, folder: str):
    """The action of submitting `text` as a prompt file (how long inputs enter: pasting 100 kB into the box
    stalls the tab for seconds)."""
    path = os.path.join(folder, "long_prompt.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)

    def act() -> None:
        uploader = page.locator('[data-testid="stFileUploaderDropzoneInput"]')
        if not uploader.is_visible():
            page.get_by_text("Or a text file").click()
        uploader.set_input_files(path)
        page.get_by_text("long_prompt.txt").wait_for()
        page.get_by_role("button", name="Analyse").click()

    return act


def click_tokens(page: Page, where=(0.2, 0.45, 0.7)) -> list[float]:
    """Click heatmap cells (fractions of its width): each selects its token; seconds until the drill-down
    shows it."""
    canvas = page.locator(".st-key-heatmap canvas, .st-key-heatmap svg.marks")
    canvas.scroll_into_view_if_needed()
    box = canvas.bounding_box()
    clicks = []
    for fx in where:
        page.evaluate(
            "() => { window.__title = document.querySelector('.st-key-token_scores')?.textContent; }"
        )
        check = "document.querySelector('.st-key-token_scores')?.textContent !== window.__title"
        at = {"x": box["width"] * fx, "y": box["height"] * 0.4}
        clicks.append(timed(page, lambda p=at: canvas.click(position=p), check))
    return clicks


def report(name: str, values: list[float], target: float | None) -> Figure:
    """Print one interaction's times. → its figure (the median, and the spread over the repetitions; the
    target is met when the slowest is under it)."""
    verdict = "" if target is None else ("  PASS" if max(values) < target else "  MISS") + f" (< {target} s)"
    each = ", ".join(f"{v:.2f}" for v in values)
    print(f"{name:<52} median {statistics.median(values):6.2f} s   [{each}]{verdict}", flush=True)
    figure = f"{statistics.median(values):.2f} s"
    if len(values) > 1:
        figure += f" ({min(values):.2f}–{max(values):.2f}, {len(values)} times)"
    return Figure(
        SECTION,
        f"{name}, wall",
        figure,
        COMMAND,
        f"< {target:g} s, each" if target is not None else "",
        None if target is None else max(values) < target,
    )


def main() -> None:
    loaded = moeviz.load_model(MODEL)
    limit = loaded.max_length or 2048  # the sample: 32,768
    print(f"moeviz app benchmark · {MODEL} · context {limit} tokens · {os.cpu_count()} CPUs")
    thousand = prompts(loaded, 1000, REPEATS)
    longest = prompts(loaded, limit, 1)[0]
    with running_app(MODEL) as url, sync_playwright() as pw, tempfile.TemporaryDirectory() as tmp:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            page = new_page(browser)
            t0 = time.perf_counter()
            page.goto(url, wait_until="domcontentloaded")
            page.evaluate(_WAIT_JS, [f"document.querySelectorAll('{HEATMAP_CELLS}').length > 0", TIMEOUT_MS])
            first = time.perf_counter() - t0
            print(f"{'first page (model load, example analysed)':<52} {first:6.2f} s", flush=True)
            figures = [
                Figure(SECTION, "first page (model load, example analysed), wall", f"{first:.2f} s", COMMAND)
            ]

            submits = [
                timed(page, submit(page, text), f"{caption_says(1000)} && {HEATMAP_CHANGED}")
                for text in thousand
            ]
            figures.append(report("1,000-token prompt: submit → heatmap", submits, 3.0))

            slider = page.get_by_role("slider", name="MoE layer")
            switches = []
            for key in ("ArrowRight", "ArrowRight", "ArrowRight", "Home"):  # layers 1, 2, 3, then 0
                check = HEATMAP_CHANGED  # each layer draws other pixels
                switches.append(timed(page, lambda k=key: slider.press(k), check))
            figures.append(report("switch MoE layer → heatmap (1,000 tokens)", switches, 0.5))

            clicks = click_tokens(page)
            figures.append(report("click a token → drill-down (1,000 tokens)", clicks, 0.5))

            page.evaluate(_HEARTBEAT_JS)
            binned = "document.querySelector('.st-key-binned canvas, .st-key-binned svg.marks') !== null"
            long_submit = timed(
                page,
                upload(page, longest, tmp),
                f"{caption_says(limit)} && {HEATMAP_CHANGED} && {binned}",
            )
            figures.append(
                report(f"{limit}-token prompt file (whole context): submit → views", [long_submit], None)
            )
            long_switch = timed(
                page,
                lambda: slider.press("ArrowRight"),
                HEATMAP_CHANGED,
            )
            figures.append(report(f"switch MoE layer ({limit} tokens)", [long_switch], 0.5))
            figures.append(
                report(f"click a token → drill-down ({limit} tokens)", click_tokens(page, (0.3,)), 0.5)
            )
            grid = (
                "document.querySelectorAll(\".st-key-heads_mean_entropy [aria-roledescription='rect mark']\")"
            )
            shown = (
                "document.querySelector('.st-key-attention_map canvas, .st-key-attention_map svg') !== null"
            )
            attention = timed(
                page,
                lambda: page.get_by_role("link", name="Attention").click(),
                f"{grid}.length === 16 && {shown}",
            )
            figures.append(report(f"Attention page, {limit} tokens: head grid + map", [attention], None))
            gaps = page.evaluate("() => { clearInterval(window.__beat); return window.__gaps; }")
            long_tasks = page.evaluate("() => window.__long")
            marks = page.evaluate(
                "() => document.querySelectorAll('[aria-roledescription$=\"mark\"]').length"
            )
            print(
                f"{'  tab responsiveness during the long prompt':<52} "
                f"longest heartbeat gap {max(gaps):.0f} ms, "
                f"{len(long_tasks)} long tasks (max {max(long_tasks, default=0):.0f} ms); "
                f"{marks} marks on the Attention page"
            )
            figures.append(
                Figure(
                    SECTION,
                    f"the tab while the {limit}-token prompt file runs",
                    f"longest gap of a 20 ms timer {max(gaps):.0f} ms; {len(long_tasks)} long tasks "
                    f"(longest {max(long_tasks, default=0):.0f} ms)",
                    COMMAND,
                )
            )
        finally:
            browser.close()
    record("app", figures)


if __name__ == "__main__":
    main()
