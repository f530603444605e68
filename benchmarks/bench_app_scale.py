"""The Routing page at scale in the real browser: `python benchmarks/bench_app_scale.py` prints the figures.

A random DeepSeek-V3-shaped model (256 routed experts, top-8 within the best 4 of 8 groups, 61 blocks of
which 58 MoE, narrow widths; tests/support/scale_models.py) is saved to a temporary folder and opened by
`streamlit run app/streamlit_app.py`, driven by Playwright in headless Debian Chromium (as bench_app.py).
Measured, each from the user's action to the frame in which the browser has drawn the result:

1. submit a new 1,000-token prompt → heatmap rendered: the whole time, and the part after the capture (from
   the frame in which the capture's progress bar went away: the model's forward is the model's cost, not
   the app's). Target: after the capture < 3 s. A fresh prompt each repetition.
2. switch MoE layer with the slider → heatmap of the new layer rendered (target < 0.5 s).
3. click a heatmap cell → that token's drill-down (its scores at every layer × every expert, its path and
   margins) drawn. At scale the drill-down is drawn on request (a click or its toggle), not after every
   capture: this is what that request costs.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from playwright.sync_api import Page, sync_playwright

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the launcher and models live with the tests
import moeviz
from benchmarks.bench_app import _WAIT_JS as WAIT_JS
from benchmarks.bench_app import REPEATS, SETTLE_MS, TIMEOUT_MS, caption_says, prompts, submit
from tests.support.scale_models import save_scale_model
from tests.support.server import CHROMIUM, CHROMIUM_ARGS, running_app

TOKENS = 1000
# "Drawn" = the heatmap's pixels differ from those before the action. bench_app.py compares the canvas's
# `toDataURL()` every frame: a PNG encoding of a large canvas per frame takes a core of the two, slowing the
# very server being timed. Here: the canvas scaled down to 48 × 48 pixels and hashed (about a millisecond).
_HEATMAP_SIG = """(() => {
  const c = document.querySelector('.st-key-heatmap canvas');
  if (!c) { const s = document.querySelector('.st-key-heatmap svg.marks'); return s ? s.innerHTML : ''; }
  const o = window.__sig || (window.__sig = document.createElement('canvas'));
  o.width = 48; o.height = 48;
  const x = o.getContext('2d');
  x.drawImage(c, 0, 0, 48, 48);
  const d = x.getImageData(0, 0, 48, 48).data;
  let h = 0;
  for (let i = 0; i < d.length; i++) h = (h * 31 + d[i]) | 0;
  return c.width + 'x' + c.height + ':' + h;
})()"""
MARK_JS = f"() => {{ window.__before = {_HEATMAP_SIG}; }}"
HEATMAP_CHANGED = f"({_HEATMAP_SIG} !== '' && {_HEATMAP_SIG} !== window.__before)"
# Watches, every frame, for the capture's progress bar to show and then go (the capture has finished).
_WATCH_PROGRESS_JS = """() => {
  window.__seen = false; window.__captured = null;
  const tick = () => {
    const bar = document.querySelector('[data-testid="stProgress"]');
    if (bar) window.__seen = true;
    else if (window.__seen && window.__captured === null) window.__captured = performance.now();
    if (window.__captured === null) requestAnimationFrame(tick);
  };
  tick();
}"""


def timed_submit(page: Page, text: str) -> tuple[float, float]:
    """(seconds from submit to the heatmap drawn, seconds from the capture's end to the heatmap drawn)."""
    page.wait_for_timeout(SETTLE_MS)
    page.evaluate(MARK_JS)
    page.evaluate(_WATCH_PROGRESS_JS)
    start = page.evaluate("() => performance.now()")
    submit(page, text)()
    end = page.evaluate(WAIT_JS, [f"{caption_says(TOKENS)} && {HEATMAP_CHANGED}", TIMEOUT_MS])
    captured = page.evaluate("() => window.__captured")
    return (end - start) / 1000, (end - (captured if captured is not None else start)) / 1000


def timed_switch(page: Page, key: str) -> float:
    page.wait_for_timeout(SETTLE_MS)
    page.evaluate(MARK_JS)
    start = page.evaluate("() => performance.now()")
    page.get_by_role("slider", name="MoE layer").press(key)
    end = page.evaluate(WAIT_JS, [HEATMAP_CHANGED, TIMEOUT_MS])
    return (end - start) / 1000


DRILLDOWN_TOGGLE = "Show this token at every layer"
DRILLDOWN_DRAWN = (
    "document.querySelector('.st-key-token_scores canvas, .st-key-token_scores svg.marks') !== null"
)


def timed_click(page: Page, fraction: float) -> float:
    """Click the heatmap at `fraction` of its width (the middle row) → the token's drill-down drawn."""
    page.wait_for_timeout(SETTLE_MS)
    canvas = page.locator(".st-key-heatmap canvas").first
    canvas.scroll_into_view_if_needed()
    box = canvas.bounding_box()
    start = page.evaluate("() => performance.now()")
    page.mouse.click(box["x"] + box["width"] * fraction, box["y"] + box["height"] * 0.5)
    end = page.evaluate(WAIT_JS, [DRILLDOWN_DRAWN, TIMEOUT_MS])
    return (end - start) / 1000


def report(name: str, values: list[float], target: float | None) -> None:
    verdict = "" if target is None else ("  PASS" if max(values) < target else "  MISS") + f" (< {target} s)"
    each = ", ".join(f"{v:.2f}" for v in values)
    spread = f"spread {max(values) - min(values):.2f} s"
    print(f"{name:<52} median {statistics.median(values):6.2f} s  {spread}  [{each}]{verdict}", flush=True)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        folder = save_scale_model("deepseek-v3", Path(tmp) / "deepseek-v3", max_position_embeddings=4096)
        loaded = moeviz.load_model(str(folder))
        routing = moeviz.capture(loaded, "warm up").layers
        print(
            f"moeviz app benchmark at scale · random DeepSeek-V3 shape: {routing[0].num_experts} experts, "
            f"top-{routing[0].k}, {len(routing)} MoE layers of {loaded.model.config.num_hidden_layers} · "
            f"{TOKENS:,}-token prompts · {os.cpu_count()} CPUs (model built in "
            f"{time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
        texts = prompts(loaded, TOKENS, REPEATS)
        del loaded
        with running_app(str(folder), start_timeout_s=300) as url, sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                t0 = time.perf_counter()
                page.goto(url, wait_until="domcontentloaded")
                cells = "document.querySelector('.st-key-heatmap canvas, .st-key-heatmap svg.marks') !== null"
                page.evaluate(WAIT_JS, [cells, TIMEOUT_MS])
                print(f"{'first page (model load, example analysed)':<52} {time.perf_counter() - t0:6.2f} s")
                totals, after = zip(*(timed_submit(page, text) for text in texts), strict=True)
                report(f"{TOKENS:,}-token prompt: submit → heatmap (all)", list(totals), None)
                report(f"{TOKENS:,}-token prompt: capture done → heatmap", list(after), 3.0)
                switches = [
                    timed_switch(page, key) for key in ("ArrowRight", "ArrowRight", "ArrowRight", "Home")
                ]
                report(f"switch MoE layer → heatmap ({TOKENS:,} tokens)", switches, 0.5)
                clicks = []
                for fraction in (0.3, 0.5, 0.7):
                    if page.get_by_role("switch", name=DRILLDOWN_TOGGLE).is_checked():  # close it first
                        page.get_by_text(DRILLDOWN_TOGGLE).click()
                        page.evaluate(WAIT_JS, [f"!({DRILLDOWN_DRAWN})", TIMEOUT_MS])
                    clicks.append(timed_click(page, fraction))
                report("click a heatmap cell → token drill-down drawn", clicks, None)
            finally:
                browser.close()


if __name__ == "__main__":
    main()
