"""The Deployment page at scale in the real browser: `python benchmarks/bench_deployment_page.py` prints the
figures and records them (`benchmarks/results/deployment_page.json`).

A random DeepSeek-V3-shaped model (256 routed experts, top-8 of 4-of-8 groups, 58 MoE layers, narrow widths;
tests/support/scale_models.py) is opened by `streamlit run app/serve.py` and driven by Playwright in headless
Debian Chromium, as bench_app_scale.py does. Each repetition submits a new 1,000-token prompt on the Routing
page (its capture is then in the server's cache: not timed) and then, each timed from the user's click to the
first frame in which the result is drawn and nothing is left stale (browser clock):

1. open the Deployment page from the menu → the Expert parallelism tab's charts;
2. the Offloading tab → its hit-rate metrics, its hit-rate curve, and everything (the cumulative bytes, the
   curve, the prefetch section with its cost; the first visit on a server times one forward for that cost);
3. the Capacity tab → its three charts;
4. on the Quantisation tab, "Quantise and compare routing" → the flip-rate and margin charts (two forwards);
5. on the Offloading tab, "Measure the prefetch recall" → its chart (one forward);

and, from the click until the page has been quiet for QUIET_MS, the CPU time of the server (the Streamlit
process) and of the browser (Chromium's renderer). Every prompt is new, so each repetition replays it afresh
(the what-ifs are cached per prompt).

Apps measured side by side in one run, their repetitions interleaved: "current" (this checkout) and, with
`--base DIR`, another checkout (e.g. `git worktree add /tmp/base-deploy HEAD`; BASE in the recorded command)
as "base". Median and spread (min–max) of `--repeats` (3) repetitions each. `--no-record` prints without
writing the results file.

    python benchmarks/bench_deployment_page.py [--base DIR] [--repeats 3] [--no-record]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from pathlib import Path

from playwright.sync_api import sync_playwright

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the launcher and models live with the tests
from benchmarks.bench_app import _WAIT_JS as WAIT_JS
from benchmarks.bench_app import SETTLE_MS, TIMEOUT_MS, WATCH_JS, caption_says, submit
from benchmarks.bench_app_scale import _QUIET_JS, TOKENS, App, app_server, scale_prompts
from benchmarks.bench_attention_page import stat
from benchmarks.record import Figure, record

QUIET_MS = 400  # after the last part is drawn: the page must stay unchanged this long before the CPU is read
_FRESH = "((e) => !!e && !e.closest('[data-stale=\"true\"]'))"
_MARKS = "document.querySelector('.st-key-' + key + ' canvas, .st-key-' + key + ' svg.marks')"
_DRAWN = f"((key) => {_FRESH}({_MARKS}))"
CAPTION, METRIC = '[data-testid="stCaptionContainer"]', '[data-testid="stMetricLabel"]'
_NOTHING_STALE = "!document.querySelector('[data-stale=\"true\"]')"


def drawn(*keys: str) -> str:
    """JS: every chart container of `keys` has drawn marks, none of them stale."""
    return " && ".join(f"{_DRAWN}('{key}')" for key in keys)


def shows(selector: str, text: str) -> str:
    """JS: an element matching `selector` that is not stale contains `text`."""
    found = f"[...document.querySelectorAll('{selector}')]"
    return f"{found}.some(e => {_FRESH}(e) && e.textContent.includes('{text}'))"


# What each step waits for: (name, the click that starts it, {part: JS that holds once the part is drawn});
# the last part of each is the step's whole result, with nothing stale.
EP_CHARTS = ("ep_bytes", "ep_comm_share")
STEPS = {
    "open the page (Expert parallelism)": {"views": f"{drawn(*EP_CHARTS)} && {_NOTHING_STALE}"},
    "the Offloading tab": {
        "metrics": shows(METRIC, "belady hit rate"),
        "curve": drawn("offload_hit_rate"),
        "all": f"{drawn('offload_hit_rate', 'offload_bytes')} && "
        f"{shows(CAPTION, 'on this model')} && {_NOTHING_STALE}",
    },
    "the Capacity tab": {
        "all": f"{drawn('capacity_drops', 'capacity_positions', 'capacity_overflow')} && {_NOTHING_STALE}"
    },
    "quantise and compare routing": {
        "all": f"{drawn('quant_flip_rate', 'quant_margins')} && {_NOTHING_STALE}"
    },
    "measure the prefetch recall": {"all": f"{drawn('prefetch_recall')} && {_NOTHING_STALE}"},
}
_PARTS_JS = """(parts) => {
  window.__seen = {};
  const checks = Object.entries(parts).map(([k, src]) => [k, new Function('return (' + src + ')')]);
  const tick = () => {
    const now = performance.now();
    for (const [k, f] of checks) if (!(k in window.__seen) && f()) window.__seen[k] = now;
    if (window.__watching) requestAnimationFrame(tick);
  };
  tick();
}"""


def timed_step(app: App, name: str, click) -> dict[str, float]:
    """Seconds from the user's click to each part of step `name` drawn; then the CPU seconds of the server
    and the browser until the page is quiet."""
    page, parts = app.page, STEPS[name]
    page.wait_for_timeout(SETTLE_MS)
    page.evaluate(WATCH_JS, [])  # the click's timestamp; the page's last change for the quiet wait
    page.evaluate(_PARTS_JS, parts)
    browser0, server0 = app.cpu()
    called = page.evaluate("() => performance.now()")
    click()
    last = list(parts)[-1]
    page.evaluate(WAIT_JS, [f"'{last}' in window.__seen", TIMEOUT_MS])
    page.evaluate(_QUIET_JS, [QUIET_MS, TIMEOUT_MS])
    browser1, server1 = app.cpu()
    seen, pressed = page.evaluate("() => [window.__seen, window.__input]")
    start = called if pressed is None else pressed
    return {
        **{part: (seen[part] - start) / 1000 for part in parts},
        "server CPU": server1 - server0,
        "browser CPU": browser1 - browser0,
    }


def deployment_round(app: App, text: str) -> dict[str, dict[str, float]]:
    """Submit `text` on the Routing page (not timed), then time each step of STEPS on the Deployment page;
    ends on its first tab, so that the next round opens the page there."""
    page = app.page
    tab = lambda label: lambda: page.get_by_role("tab", name=label, exact=True).click()  # noqa: E731
    button = lambda label: lambda: page.get_by_role("button", name=label).click()  # noqa: E731
    heatmap = "document.querySelector('.st-key-heatmap canvas, .st-key-heatmap svg.marks') !== null"
    if page.get_by_role("heading", name="Deployment what-ifs").count():
        page.get_by_role("link", name="Routing", exact=True).click()
    page.evaluate(WAIT_JS, [heatmap, TIMEOUT_MS])
    submit(page, text)()
    page.evaluate(WAIT_JS, [f"{caption_says(TOKENS)} && {heatmap}", TIMEOUT_MS])
    out = {}

    def step(name: str, click) -> None:
        out[name] = timed_step(app, name, click)

    step("open the page (Expert parallelism)", lambda: page.get_by_role("link", name="Deployment").click())
    step("the Offloading tab", tab("Offloading"))
    step("the Capacity tab", tab("Capacity"))
    tab("Quantisation")()
    page.evaluate(WAIT_JS, [shows("button", "Quantise and compare routing"), TIMEOUT_MS])
    step("quantise and compare routing", button("Quantise and compare routing"))
    tab("Offloading")()
    page.evaluate(WAIT_JS, [shows("button", "Measure the prefetch recall"), TIMEOUT_MS])
    step("measure the prefetch recall", button("Measure the prefetch recall"))
    tab("Expert parallelism")()
    page.evaluate(WAIT_JS, [drawn(*EP_CHARTS), TIMEOUT_MS])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--base", type=Path, help="another checkout, measured side by side as 'base'")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    repo = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        folder, loaded, texts, seconds = scale_prompts(tmp, args.repeats)
        print(
            "moeviz Deployment page at scale · random DeepSeek-V3 shape, 256 experts × 58 MoE layers · "
            f"{TOKENS:,}-token prompts · {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} "
            f"(model built in {seconds:.0f} s)",
            flush=True,
        )
        del loaded
        apps = [("current", repo)]
        if args.base is not None:
            apps.insert(0, ("base", args.base.resolve()))
        rounds: dict[str, list[dict[str, dict[str, float]]]] = {name: [] for name, _ in apps}
        with sync_playwright() as pw, contextlib.ExitStack() as stack:
            running = [stack.enter_context(app_server(n, r, folder, {}, pw)) for n, r in apps]
            for text in texts:
                for app in running:  # interleaved: the machine's load falls on each alike
                    measured = deployment_round(app, text)
                    rounds[app.name].append(measured)
                    for step, parts in measured.items():
                        print(
                            f"  {app.name:<8} {step}: " + ", ".join(f"{k} {v:.2f}" for k, v in parts.items())
                        )
    print(f"Deployment page, {TOKENS:,} tokens × 256 experts × 58 MoE layers ({args.repeats} repeats)")
    for name, measured in rounds.items():
        for step in STEPS:
            print(f"  {name:<8} {step}: {summary(measured, step)}")
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    if not args.no_record:
        print(record("bench_deployment_page", figures(rounds, args)))


def summary(measured: list[dict[str, dict[str, float]]], step: str) -> str:
    """Each part of `step` as its median and spread over the repetitions."""
    return "; ".join(f"{part} {stat([m[step][part] for m in measured])}" for part in measured[0][step])


def figures(rounds: dict[str, list[dict[str, dict[str, float]]]], args: argparse.Namespace) -> list[Figure]:
    """One figure per step, the base's beside it when measured."""
    mine, base = rounds["current"], rounds.get("base")
    command = "python benchmarks/bench_deployment_page.py" + (" --base BASE" if base else "")
    shape = f"Deployment page (DeepSeek-V3 shape, 256 experts × 58 MoE layers, {TOKENS:,} tokens)"
    return [
        Figure(
            "The app in a browser",
            f"{shape}: {step} → drawn",
            summary(mine, step) + (f"; base: {summary(base, step)}" if base else ""),
            command,
        )
        for step in STEPS
    ]


if __name__ == "__main__":
    main()
