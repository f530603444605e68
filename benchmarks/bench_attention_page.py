"""The Attention page at scale in the real browser: `python benchmarks/bench_attention_page.py` prints the
figures and records them (`benchmarks/results/bench_attention_page.json`).

A random DeepSeek-V3-shaped model (61 blocks, every one with softmax (MLA) attention, 2 heads, narrow
widths; tests/support/scale_models.py) is opened by `streamlit run app/serve.py` and driven by
Playwright in headless Debian Chromium, as bench_app_scale.py does. Each repetition submits a new
1,000-token prompt on the Routing page (the capture, attention included, is then in the server's cache: not
timed) and then opens the Attention page from the menu. Measured from that click, in the browser's clock,
the first frame in which

- first paint: the page's title and the first head's map are drawn (a canvas or SVG marks, not stale);
- summaries: the head grid's four heatmaps are drawn (the per-layer summaries of the layers it shows);
- total: every view of the page is drawn, the KV-cache what-if (its chart and caption) last, and nothing is
  stale;

and, from the click until the page has been quiet for QUIET_MS, the CPU time of the server (the Streamlit
process) and of the browser (Chromium's renderer, DevTools `Performance.getMetrics`). Each prompt is new, so
every repetition computes the summaries afresh (they are cached per capture).

Apps measured side by side in one run, their repetitions interleaved: "current" (this checkout) and, with
`--base DIR`, another checkout (e.g. `git worktree add /tmp/base-attn HEAD`; BASE in the recorded command) as
"base". Median and spread (min–max) of `--repeats` (3) repetitions each. `--no-record` prints without writing
the results file.

    python benchmarks/bench_attention_page.py [--base DIR] [--repeats 3] [--no-record]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import sys
import tempfile
from pathlib import Path

from playwright.sync_api import sync_playwright

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the launcher and models live with the tests
from benchmarks.bench_app import _WAIT_JS as WAIT_JS
from benchmarks.bench_app import SETTLE_MS, TIMEOUT_MS, caption_says, submit
from benchmarks.bench_app_scale import _QUIET_JS, TOKENS, App, app_server, print_profile, scale_prompts
from benchmarks.record import Figure, record

QUIET_MS = 400  # after the last view is drawn: the page must stay unchanged this long before the CPU is read
GRID_KEYS = tuple(  # the head grid's heatmaps (st.container keys)
    f"heads_mean_{m}" for m in ("entropy", "mean_distance", "sink_mass", "local_mass")
)
_DRAWN = (
    "((key) => { const e = document.querySelector('.st-key-' + key);"
    " return !!e && !e.closest('[data-stale=\"true\"]') && !!e.querySelector('canvas, svg.marks'); })"
)
# When (browser clock) each part of the page was first seen drawn, checked every animation frame.
_WATCH_JS = f"""(grid) => {{
  const drawn = {_DRAWN};
  window.__seen = {{}};
  window.__lastChange = performance.now();
  const parts = {{
    paint: () => [...document.querySelectorAll('h1')].some(h => h.textContent.trim() === 'Attention'
      && !h.closest('[data-stale="true"]')) && drawn('attention_map'),
    summaries: () => grid.every(drawn),
    total: () => grid.every(drawn) && drawn('attention_map') && drawn('kv_whatif')
      && [...document.querySelectorAll('[data-testid="stCaptionContainer"]')]
        .some(c => c.textContent.includes('would hold'))
      && !document.querySelector('[data-stale="true"]'),
  }};
  window.__watching = true;
  const tick = () => {{
    const now = performance.now();
    for (const [k, f] of Object.entries(parts)) if (!(k in window.__seen) && f()) window.__seen[k] = now;
    if (window.__watching) requestAnimationFrame(tick);
  }};
  tick();
}}"""
ALL_SEEN = "['paint', 'summaries', 'total'].every(k => k in window.__seen)"


@dataclasses.dataclass
class Sample:
    """One opening of the Attention page: seconds from the click to each part drawn; CPU seconds."""

    paint: float
    summaries: float
    total: float
    server_cpu: float
    browser_cpu: float


def open_attention(app: App, text: str, profile: bool = False) -> Sample:
    """Submit `text` on the Routing page (not timed), then open the Attention page and time it (with
    `profile`, print where the browser spent its CPU meanwhile)."""
    page = app.page
    heatmap = "document.querySelector('.st-key-heatmap canvas, .st-key-heatmap svg.marks') !== null"
    if page.get_by_role("heading", name="Attention", exact=True).count():
        page.get_by_role("link", name="Routing", exact=True).click()
    try:
        page.evaluate(WAIT_JS, [heatmap, TIMEOUT_MS])
    except Exception:
        page.screenshot(path="/tmp/shots/attn-bench-fail.png")
        raise
    submit(page, text)()
    page.evaluate(WAIT_JS, [f"{caption_says(TOKENS)} && {heatmap}", TIMEOUT_MS])
    page.wait_for_timeout(SETTLE_MS)
    page.evaluate(_WATCH_JS, list(GRID_KEYS))
    if profile:
        app.cdp.send("Profiler.enable")
        app.cdp.send("Profiler.setSamplingInterval", {"interval": 200})
        app.cdp.send("Profiler.start")
    browser0, server0 = app.cpu()
    start = page.evaluate("() => performance.now()")
    page.get_by_role("link", name="Attention", exact=True).click()
    page.evaluate(WAIT_JS, [ALL_SEEN, TIMEOUT_MS])
    page.evaluate(_QUIET_JS, [QUIET_MS, TIMEOUT_MS])
    browser1, server1 = app.cpu()
    if profile:
        print_profile(
            f"{app.name}: the browser's self time opening the page", app.cdp.send("Profiler.stop")["profile"]
        )
    seen = page.evaluate("() => window.__seen")
    return Sample(
        (seen["paint"] - start) / 1000,
        (seen["summaries"] - start) / 1000,
        (seen["total"] - start) / 1000,
        server1 - server0,
        browser1 - browser0,
    )


def stat(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} s ({min(values):.2f}–{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--base", type=Path, help="another checkout, measured side by side as 'base'")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--profile", action="store_true", help="the browser's CPU profile, last opening")
    args = parser.parse_args()
    repo = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        folder, loaded, texts, seconds = scale_prompts(tmp, args.repeats)
        print(
            "moeviz Attention page at scale · random DeepSeek-V3 shape, "
            f"{loaded.model.config.num_hidden_layers} attention layers · {TOKENS:,}-token prompts · "
            f"{os.cpu_count()} CPUs, load average "
            f"{os.getloadavg()[0]:.1f} (model built in {seconds:.0f} s)",
            flush=True,
        )
        del loaded
        apps = [("current", repo)]
        if args.base is not None:
            apps.insert(0, ("base", args.base.resolve()))
        samples: dict[str, list[Sample]] = {name: [] for name, _ in apps}
        with sync_playwright() as pw, contextlib.ExitStack() as stack:
            running = [stack.enter_context(app_server(n, r, folder, {}, pw)) for n, r in apps]
            for i, text in enumerate(texts):
                for app in running:  # interleaved: the machine's load falls on each alike
                    sample = open_attention(app, text, args.profile and i == len(texts) - 1)
                    samples[app.name].append(sample)
                    print(f"  {app.name:<8} {sample}", flush=True)
    print(f"Attention page, {TOKENS:,} tokens × 61 layers, the trace cached ({args.repeats} repeats)")
    for name, values in samples.items():
        print(
            f"  {name:<8} first paint {stat([s.paint for s in values])}  summaries "
            f"{stat([s.summaries for s in values])}  total {stat([s.total for s in values])}  "
            f"server CPU {stat([s.server_cpu for s in values])}  browser CPU "
            f"{stat([s.browser_cpu for s in values])}"
        )
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    if not args.no_record:
        print(record("bench_attention_page", figures(samples, args)))


TARGET_S = 5.0  # the page's total, the trace cached (median of the repeats)


def figures(samples: dict[str, list[Sample]], args: argparse.Namespace) -> list[Figure]:
    """The total against TARGET_S, and first paint against the summaries (each with the base's beside it
    when measured)."""
    mine, base = samples["current"], samples.get("base")
    command = "python benchmarks/bench_attention_page.py" + (" --base BASE" if base else "")
    shape = f"Attention page (DeepSeek-V3 shape, 61 attention layers, {TOKENS:,} tokens, trace cached)"

    def beside(part: str) -> str:
        text = stat([getattr(s, part) for s in mine])
        return text + (f"; base {stat([getattr(s, part) for s in base])}" if base else "")

    paint = statistics.median(s.paint for s in mine)
    summaries = statistics.median(s.summaries for s in mine)
    cpu = stat([s.server_cpu for s in mine]) + " server, " + stat([s.browser_cpu for s in mine]) + " browser"
    if base:
        cpu += "; base " + stat([s.server_cpu for s in base]) + " server, "
        cpu += stat([s.browser_cpu for s in base]) + " browser"
    return [
        Figure(
            "The app in a browser",
            f"{shape}: open the page → every view drawn (map, head grid, KV-cache what-if)",
            beside("total"),
            command,
            target=f"≤ {TARGET_S:g} s",
            met=statistics.median(s.total for s in mine) <= TARGET_S,
        ),
        Figure(
            "The app in a browser",
            f"{shape}: first paint (title + the head's map) vs the head grid's summaries drawn",
            f"first paint {beside('paint')}; summaries {beside('summaries')}",
            command,
            target="first paint before the summaries",
            met=paint < summaries,
        ),
        Figure(
            "The app in a browser",
            f"{shape}: CPU time of opening the page (Streamlit server, Chromium renderer)",
            cpu,
            command,
        ),
    ]


if __name__ == "__main__":
    main()
