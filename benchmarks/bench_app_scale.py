"""The Routing page at scale in the real browser: `python benchmarks/bench_app_scale.py` prints the figures.

A random DeepSeek-V3-shaped model (256 routed experts, top-8 within the best 4 of 8 groups, 61 blocks of
which 58 MoE, narrow widths; tests/support/scale_models.py) is saved to a temporary folder and opened by
`streamlit run app/serve.py`, driven by Playwright in headless Debian Chromium (as bench_app.py).
Measured, each from the user's action to the frame in which the browser has drawn the result:

1. submit a new 1,000-token prompt → heatmap rendered, the model's forward included (a fresh prompt each
   repetition; the CPU figures separate the server's part).
2. switch MoE layer with the slider → heatmap of the new layer rendered (target < 0.5 s).
3. sort the expert axis (by load, back by id) → heatmap redrawn; 4. pick an expert outside the layer's
   top-N (the least loaded, from the benchmark's own capture of the prompt) → heatmap redrawn with its row;
5. open the drill-down of a token not shown before (its scores at every layer × every expert, then its
   path and margins) → its scores drawn (targets < 0.5 s). At scale it is drawn on request, by a heatmap
   click or its toggle: the toggle here (a click on the heatmap's canvas selected no cell in headless
   Chromium, at HEAD as now); a new token each time, as a user's clicks bring (the same token's charts
   again would come from Streamlit's cache of sent messages).

The wall time is the browser's clock from the user's input — the timestamp of the pointer or key press
event the action dispatched in the page; Playwright's own checks before it presses (finding the option,
waiting for it to stand still) are not the user's — to the first frame with the result and nothing visible
left stale (faded) from before. Besides it, each interaction reports what it cost in CPU, which the load
of a shared machine does not inflate: the browser's (Chromium's renderer process, `Performance.getMetrics`
ProcessTime over the DevTools protocol) and the server's (the Streamlit process, user + system), from the
action until the page has been quiet for QUIET_MS; and when each chart of the layer's views was last
redrawn (a signature of its canvas, read in the frames after Vega drew on it, or of its SVG), ms after the
input.

Each interaction is reported as its median and spread (min–max) over its repetitions. Apps measured side by
side in one run, one server and one browser each, their interactions interleaved: "current" (this checkout;
`--variants svg raster` as two apps: MOEVIZ_RASTER_ABOVE past any heatmap, or the library's default), and
with `--base DIR` another checkout (e.g. `git worktree add /tmp/rt-base HEAD`) as "base". `--skip-submit`
leaves out the new prompts (measurement 1) after the first, which only loads the 1,000-token trace.
`--profile` prints, per app, where the browser spent one layer switch (a CPU profile, self time by script).

    python benchmarks/bench_app_scale.py [--base DIR] [--variants svg raster] [--skip-submit] [--profile]

The figures are recorded (`benchmarks/record.py`) with the command run; a base checkout is named BASE there
(e.g. `git worktree add /tmp/base HEAD`, then `--base /tmp/base`).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import psutil
from playwright.sync_api import Page, sync_playwright

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the launcher and models live with the tests
import moeviz
import tests.support.server as server
from benchmarks.bench_app import _WAIT_JS as WAIT_JS
from benchmarks.bench_app import (
    HEATMAP_CHANGED,
    INIT_JS,
    REPEATS,
    SETTLE_MS,
    TIMEOUT_MS,
    WATCH_JS,
    caption_says,
    prompts,
    submit,
)
from benchmarks.record import Figure, record
from tests.support.scale_models import save_scale_model
from tests.support.server import CHROMIUM, CHROMIUM_ARGS, running_app

# nothing kept between servers (`moeviz.trace.kept`): each server loads the model; bench_startup measures
# the first page with the example kept
os.environ["MOEVIZ_CACHE_DIR"] = ""

TOKENS = 1000
QUIET_MS = 400  # after the result is drawn: the page must stay unchanged this long before the CPU is read
CHARTS = ("heatmap", "binned", "strip", "load", "token_scores")  # the containers (st.container keys) watched
# Resolves once nothing watched has changed for `quiet` ms and nothing on the page is stale.
_QUIET_JS = """([quiet, timeout]) => new Promise((resolve, reject) => {
  const start = performance.now();
  const tick = () => {
    const now = performance.now();
    const stale = document.querySelector('[data-stale="true"]');
    if (!stale && now - Math.max(window.__lastChange || 0, start) > quiet) { window.__watching = false;
      resolve(now); }
    else if (now - start > timeout) reject(new Error('the page never went quiet'));
    else requestAnimationFrame(tick);
  };
  tick();
})"""
# Watches, every frame, for the capture's progress bar to show and then go (the capture has finished).
DRILLDOWN_TOGGLE = "Show this token at every layer"
DRILLDOWN_DRAWN = (
    "document.querySelector('.st-key-token_scores canvas, .st-key-token_scores svg.marks') !== null"
)


@dataclasses.dataclass
class Sample:
    """One interaction on one app: wall seconds (action → drawn), browser and server CPU seconds (action →
    quiet), and each chart's last redraw in ms after the action."""

    wall: float
    browser_cpu: float
    server_cpu: float
    charts: dict[str, float]
    drawn_at: float  # the browser's clock (ms) in the frame the result was drawn


@dataclasses.dataclass
class App:
    """One app under test: its browser page, DevTools session and server process."""

    name: str
    page: Page
    cdp: object
    server: psutil.Process

    def cpu(self) -> tuple[float, float]:
        """(the renderer's CPU seconds, the server's CPU seconds, children included) so far."""
        metrics = {m["name"]: m["value"] for m in self.cdp.send("Performance.getMetrics")["metrics"]}
        times = self.server.cpu_times()
        return metrics["ProcessTime"], times.user + times.system

    def timed(self, action: Callable[[], None], check: str, prepare: Callable[[], None] | None = None):
        """`action()` → the first frame in which `check` holds (wall), then → quiet (CPU, charts)."""
        self.page.wait_for_timeout(SETTLE_MS)
        if prepare is not None:
            prepare()
        self.page.evaluate(WATCH_JS, list(CHARTS))
        browser0, server0 = self.cpu()
        called = self.page.evaluate("() => performance.now()")
        action()
        end = self.page.evaluate(WAIT_JS, [check, TIMEOUT_MS])
        self.page.evaluate(_QUIET_JS, [QUIET_MS, TIMEOUT_MS])
        browser1, server1 = self.cpu()
        changed, pressed = self.page.evaluate("() => [window.__changed, window.__input]")
        start = called if pressed is None else pressed
        charts = {k: v - start for k, v in changed.items()}
        return Sample((end - start) / 1000, browser1 - browser0, server1 - server0, charts, end)


def submit_action(app: App, text: str) -> Callable[[], None]:
    def act() -> None:
        submit(app.page, text)()

    return act


def switch_action(app: App, key: str) -> Callable[[], None]:
    return lambda: app.page.get_by_role("slider", name="MoE layer").press(key)


def select_action(app: App, label: str, option: re.Pattern) -> tuple[Callable, Callable]:
    """(prepare, action): open the selectbox `label` and type the start of the option; then click the
    option whose label matches `option` (Enter would take the first match of the typed text, which may be
    another option: "7" matches "17 · …")."""
    typed = option.pattern.lstrip("^").split(" ")[0]

    def prepare() -> None:
        box = app.page.get_by_role("combobox", name=label, exact=True).first  # not "Sort experts by"
        box.scroll_into_view_if_needed()
        box.click()
        app.page.keyboard.type(typed)
        app.page.get_by_role("option", name=option).first.wait_for()

    return prepare, lambda: app.page.get_by_role("option", name=option).first.click()


def drilldown_action(app: App) -> tuple[Callable, Callable]:
    """(prepare, action): close the token's drill-down if open and pick the next token (one whose views
    were never drawn: Streamlit sends a chart the browser already has as a reference to its cached copy, so
    reopening one token would time a cache hit); open its drill-down with the toggle (what a heatmap click
    also does: in headless Chromium here a click on the heatmap's canvas selected no cell, at HEAD as now,
    so the toggle stands in for it)."""
    toggle = app.page.get_by_role("switch", name=DRILLDOWN_TOGGLE)

    def prepare() -> None:
        if toggle.is_checked():
            app.page.get_by_text(DRILLDOWN_TOGGLE).click()
            app.page.evaluate(WAIT_JS, [f"!({DRILLDOWN_DRAWN})", TIMEOUT_MS])
        picker = app.page.get_by_role("combobox", name="Token", exact=True)
        picker.scroll_into_view_if_needed()
        before = picker.input_value()
        picker.click()
        app.page.keyboard.press("ArrowDown")
        app.page.keyboard.press("Enter")
        changed = "([box, before]) => box.value !== before"
        app.page.wait_for_function(changed, arg=[picker.element_handle(), before], timeout=TIMEOUT_MS)
        app.page.evaluate(WAIT_JS, ["true", TIMEOUT_MS])
        app.page.wait_for_timeout(SETTLE_MS)
        toggle.scroll_into_view_if_needed()

    return prepare, lambda: app.page.get_by_text(DRILLDOWN_TOGGLE).click()


def report(name: str, samples: dict[str, list[Sample]], target: float | None) -> dict[str, list[Sample]]:
    """Print one interaction's medians and spreads per app (wall, browser CPU, server CPU, each chart's
    last redraw); → the samples."""
    print(f"{name}", flush=True)
    for app, values in samples.items():
        wall = [s.wall for s in values]
        verdict = "" if target is None else ("PASS" if max(wall) < target else "MISS") + f" (< {target} s)"

        def stat(xs: list[float], unit: str = "s") -> str:
            return f"{statistics.median(xs):6.2f} {unit} ({min(xs):.2f}–{max(xs):.2f})"

        charts = {k for s in values for k in s.charts}
        drawn = "  ".join(
            f"{k} {statistics.median([s.charts[k] for s in values if k in s.charts]):.0f}"
            for k in CHARTS
            if k in charts
        )
        print(
            f"  {app:<8} wall {stat(wall)}  browser CPU {stat([s.browser_cpu for s in values])}  "
            f"server CPU {stat([s.server_cpu for s in values])}  {verdict}",
            flush=True,
        )
        if drawn:
            print(f"  {'':<8} last redraw, ms after the action (median): {drawn}", flush=True)
    return samples


def profile_switch(app: App) -> None:
    """Where the renderer spent one layer switch: self time per script (and the top functions)."""
    app.page.wait_for_timeout(SETTLE_MS)
    app.cdp.send("Profiler.enable")
    app.cdp.send("Profiler.setSamplingInterval", {"interval": 200})
    app.cdp.send("Profiler.start")
    app.timed(switch_action(app, "ArrowRight"), HEATMAP_CHANGED)
    print_profile(f"{app.name}: self time of one layer switch", app.cdp.send("Profiler.stop")["profile"])


def print_profile(heading: str, profile: dict) -> None:
    """Print the self time of the browser's main thread in a DevTools CPU profile, ms by script, then by
    function."""
    nodes = {n["id"]: n for n in profile["nodes"]}
    deltas: collections.Counter = collections.Counter()
    for node_id, delta in zip(profile["samples"], profile["timeDeltas"], strict=True):
        deltas[node_id] += delta
    by_script: collections.Counter = collections.Counter()
    by_function: collections.Counter = collections.Counter()
    for node_id, micros in deltas.items():
        frame = nodes[node_id]["callFrame"]
        script = frame["url"].rsplit("/", 1)[-1] or f"({frame['functionName'] or 'native'})"
        by_script[script] += micros / 1000
        function = f"{frame['functionName'] or '(anonymous)'} {script}:{frame['lineNumber']}"
        by_function[function] += micros / 1000
    print(f"  {heading}, ms by script, then by function:", flush=True)
    for script, ms in by_script.most_common(8):
        print(f"    {ms:8.0f}  {script}")
    for function, ms in by_function.most_common(12):
        print(f"    {ms:8.0f}  {function[:100]}")


@contextlib.contextmanager
def app_server(name: str, repo: Path, folder: Path, env: dict[str, str | None], pw):
    """One app (a server from `repo` with `env` on top, and a browser of its own) on the page at scale."""
    saved = {k: os.environ.get(k) for k in env}
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    known = {p.pid for p in psutil.Process().children()}
    server.REPO, repo_before = repo, server.REPO  # `running_app` starts Streamlit in server.REPO
    try:
        with running_app(str(folder), start_timeout_s=300) as url:
            (process,) = [p for p in psutil.Process().children() if p.pid not in known]
            browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.add_init_script(INIT_JS)
                cdp = page.context.new_cdp_session(page)
                cdp.send("Performance.enable", {"timeDomain": "threadTicks"})
                page.goto(url, wait_until="domcontentloaded")
                yield App(name, page, cdp, process)
            finally:
                browser.close()
    finally:
        server.REPO = repo_before
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def interleaved(apps: list[App], steps: list[Callable[[App], Sample]]) -> dict[str, list[Sample]]:
    """Each step on every app in turn (the load of the machine falls on each alike)."""
    out: dict[str, list[Sample]] = {app.name: [] for app in apps}
    for step in steps:
        for app in apps:
            out[app.name].append(step(app))
    return out


def measure(
    apps: list[App], texts: list[str], quiet: list[int], skip_submit: bool, profile: bool
) -> dict[str, dict[str, list[Sample]]]:
    """Every interaction on every app, interleaved; `quiet`: experts outside the top-N of the first MoE
    layer, least loaded first. → {interaction: {app: samples}} of the interactions with a target."""
    t0 = time.perf_counter()
    cells = "document.querySelector('.st-key-heatmap canvas, .st-key-heatmap svg.marks') !== null"
    for app in apps:
        app.page.evaluate(WAIT_JS, [cells, TIMEOUT_MS])
    print(f"{'first pages (model load, example analysed)':<52} {time.perf_counter() - t0:6.2f} s")

    def timed_submit(text: str):
        def step(app: App) -> Sample:
            return app.timed(submit_action(app, text), f"{caption_says(TOKENS)} && {HEATMAP_CHANGED}")

        return step

    submits = interleaved(apps, [timed_submit(t) for t in (texts[:1] if skip_submit else texts)])
    report(f"{TOKENS:,}-token prompt: submit → heatmap (with the capture)", submits, None)
    switches = interleaved(
        apps,
        [
            lambda app, key=key: app.timed(switch_action(app, key), HEATMAP_CHANGED)
            for key in ("ArrowRight", "ArrowRight", "ArrowRight", "Home")
        ],
    )
    walls = {"layer switch": report(f"switch MoE layer → heatmap ({TOKENS:,} tokens)", switches, 0.5)}

    def select(label: str, option: str):
        def step(app: App) -> Sample:
            prepare, action = select_action(app, label, re.compile(option))
            return app.timed(action, HEATMAP_CHANGED, prepare)

        return step

    sorts = interleaved(apps, [select("Sort experts by", o) for o in ("^load", "^id", "^load", "^id")])
    walls["sort change"] = report("sort the experts (load / id) → heatmap", sorts, 0.5)
    picks = interleaved(apps, [select("Expert", rf"^{e} · ") for e in quiet[:3]])
    walls["expert pick"] = report("pick an expert outside the top-N → heatmap", picks, 0.5)

    def drilldown(app: App) -> Sample:
        prepare, action = drilldown_action(app)
        return app.timed(action, DRILLDOWN_DRAWN, prepare)

    opened = interleaved(apps, [drilldown] * 3)
    walls["token drill-down"] = report("open the token's drill-down (toggle) → drawn", opened, 0.5)
    if profile:
        for app in apps:
            profile_switch(app)
    return walls


TARGET_S = 0.5  # each interaction, from the end of the action to the chart drawn (median over repeats)
WHAT = {  # interaction -> what the figure measures
    "layer switch": "switch the MoE layer → heatmap redrawn",
    "sort change": "sort the experts (load / id) → heatmap redrawn",
    "expert pick": "pick an expert outside the top-N → heatmap redrawn",
    "token drill-down": "open a token's drill-down (every layer × expert) → drawn",
}


def figures(walls: dict[str, dict[str, list[Sample]]], args: argparse.Namespace) -> list[Figure]:
    """One Figure per interaction: this checkout's wall seconds and the browser's CPU seconds (median,
    min–max; its first variant), the base's beside them when measured; met = the wall median within
    TARGET_S."""

    def stat(xs: list[float]) -> str:
        return f"{statistics.median(xs):.2f} s ({min(xs):.2f}–{max(xs):.2f})"

    def text(samples: list[Sample]) -> str:
        return f"{stat([s.wall for s in samples])}, browser CPU {stat([s.browser_cpu for s in samples])}"

    command = "python benchmarks/bench_app_scale.py" + (" --base BASE" if args.base else "")
    command += " --skip-submit" if args.skip_submit else ""
    rows = []
    for name, by_app in walls.items():
        mine = by_app[args.variants[0]]
        shown = text(mine) + (f"; base {text(by_app['base'])}" if "base" in by_app else "")
        what = f"Routing page at scale (DeepSeek-V3 shape, 256 experts, 58 MoE layers, {TOKENS:,} tokens): "
        rows.append(
            Figure(
                "The app in a browser",
                what + WHAT[name],
                shown,
                command,
                target=f"≤ {TARGET_S} s",
                met=statistics.median(s.wall for s in mine) <= TARGET_S,
            )
        )
    return rows


VARIANTS = {"svg": str(10**12), "raster": None}  # MOEVIZ_RASTER_ABOVE of each (None: the library's)
REPO = Path(__file__).resolve().parents[1]


def least_loaded(loaded: moeviz.LoadedModel, text: str) -> list[int]:
    """The experts of the first MoE layer for `text`, least loaded first (outside any top-N)."""
    routing = moeviz.capture(loaded, text).layers[0]
    experts = np.asarray(routing.experts).reshape(-1)
    counts = np.bincount(experts[experts >= 0], minlength=routing.num_experts)
    return [int(e) for e in np.argsort(counts, kind="stable")]


def scale_prompts(tmp: str, count: int) -> tuple[Path, moeviz.LoadedModel, list[str], float]:
    """The DeepSeek-V3-shaped model saved in `tmp` (a 4,096-token context) and loaded, `count` different
    prompts of TOKENS tokens for it, and the seconds that took."""
    start = time.perf_counter()
    folder = save_scale_model("deepseek-v3", Path(tmp) / "deepseek-v3", max_position_embeddings=4096)
    loaded = moeviz.load_model(str(folder))
    return folder, loaded, prompts(loaded, TOKENS, count), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=["raster"])
    parser.add_argument("--base", type=Path, help="another checkout, measured side by side as 'base'")
    parser.add_argument("--skip-submit", action="store_true")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder, loaded, texts, seconds = scale_prompts(tmp, REPEATS)
        routing = moeviz.capture(loaded, "warm up").layers
        print(
            f"moeviz app benchmark at scale · random DeepSeek-V3 shape: {routing[0].num_experts} experts, "
            f"top-{routing[0].k}, {len(routing)} MoE layers of {loaded.model.config.num_hidden_layers} · "
            f"{TOKENS:,}-token prompts · {os.cpu_count()} CPUs, load average "
            f"{os.getloadavg()[0]:.1f} (model built in {seconds:.0f} s)",
            flush=True,
        )
        # the experts outside the top-N of the page's layer after the switches (the first), from the last text
        quiet = least_loaded(loaded, texts[0] if args.skip_submit else texts[-1])
        del loaded
        apps = [(v, REPO, {"MOEVIZ_RASTER_ABOVE": VARIANTS[v]}) for v in args.variants]
        if args.base is not None:
            apps.insert(0, ("base", args.base.resolve(), {"MOEVIZ_RASTER_ABOVE": None}))
        with sync_playwright() as pw, contextlib.ExitStack() as stack:
            running = [stack.enter_context(app_server(n, repo, folder, env, pw)) for n, repo, env in apps]
            print("apps: " + ", ".join(f"{n} ({repo}, {env})" for n, repo, env in apps), flush=True)
            walls = measure(running, texts, quiet, args.skip_submit, args.profile)
        print(f"load average at the end {os.getloadavg()[0]:.1f}")
    record("bench_app_scale", figures(walls, args))


if __name__ == "__main__":
    main()
