"""Start-up cost: what a command pays before it does anything, and the app's first page on a cold server.

`python benchmarks/bench_startup.py [--base DIR] [--app] [--repeats 3]` prints, per contender, the median
and the spread (min–max) over the repeats of wall time and CPU time (user + system of the child process,
from `os.wait4`), and the ratio of each median to the peer's:

- CLI, each command in a fresh interpreter: `moeviz --version`, `--help`, `report --help`, `python -c
  "import moeviz"` (peer: `python -c "import torch"`, the import every model command pays once), and
  `moeviz report` on a short prompt (peer: transformers alone loading the sample and running the prompt);
- with `--base DIR`, the same commands from another checkout of moeviz (the previous version: `git worktree
  add /tmp/startup-base HEAD`), run in the same rounds;
- with `--app`, the app's Routing page on the default sample in headless Debian Chromium, three new servers
  for each repeat: a first start on a new cache folder (`MOEVIZ_CACHE_DIR`; a new install: the example's
  routing read from the sample's bundled file, `moeviz.models.bundled_examples`, or, in a version before it,
  captured and kept), a later start on the same folder (the example kept, `moeviz.trace.kept`, or bundled),
  and a start with keeping off (`MOEVIZ_CACHE_DIR=""`: nothing read from disk, the example captured, as for a
  model of the user's the first time). Seconds from the launch to the server's health check answering, then
  from opening its URL (at once) to its first paint (the page's title), to the page's own widgets (the input
  picker), to its views drawn (`VIEWS`: every chart but the token's attention row), to the attention row drawn
  (later, on a start that drew the page before torch) and to the end of the first run with every chart drawn;
  from the launch to the views; with the server's CPU time up to the views; then a second session's views on
  the same server in a new browser context (everything cached on the server; the browser's cache empty: what
  the page costs the browser alone), and again in the first session's browser context (Streamlit's scripts in
  its cache, as in a browser that opened the app before). Each checkout is byte-compiled first (`compiled`).

The contenders run interleaved (each round runs every one once, the order rotated round by round) so the
machine's load hits them alike; torch gets one thread (OMP_NUM_THREADS=1). On a shared machine wall time
follows the load: read the CPU columns.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from record import Figure, flags, record

REPO = Path(__file__).resolve().parents[1]
PROMPT = "The quick brown fox jumps over the lazy dog."
SAMPLE = "sample:mixtral-healthy"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
# The moeviz of `tree` first on the path, whatever the environment has installed
LAUNCH = "import sys; sys.path.insert(0, {tree!r}); from moeviz.cli import main; sys.exit(main(sys.argv[1:]))"
PLAIN_FORWARD = f"""
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
torch.set_num_threads(1)
folder = {str(REPO / "sample_models" / "mixtral-healthy")!r}
model = AutoModelForCausalLM.from_pretrained(folder)
ids = AutoTokenizer.from_pretrained(folder)({PROMPT!r}, return_tensors="pt")
with torch.no_grad():
    model(**ids)
"""
CLI_CASES = {  # case -> the peer it is compared with
    "--version": "import torch",
    "--help": "import torch",
    "report --help": "import torch",
    "import moeviz": "import torch",
    "report (short prompt)": "transformers alone",
}
PEERS = {"import torch": "import torch", "transformers alone": PLAIN_FORWARD}


@dataclass
class Samples:
    """Per contender, the wall and CPU seconds of each repeat."""

    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)


def timed_process(argv: list[str], cwd: Path = REPO) -> tuple[float, float]:
    """Wall and CPU seconds (user + system) of one child process, which must exit 0."""
    start = time.perf_counter()
    child = subprocess.Popen(argv, cwd=cwd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    child.returncode = os.waitstatus_to_exitcode(status)
    stderr = child.stderr.read().decode(errors="replace") if child.stderr else ""
    child.stderr.close()
    if child.returncode != 0:
        raise SystemExit(f"{argv} exited {child.returncode}:\n{stderr[-2000:]}")
    return wall, usage.ru_utime + usage.ru_stime


def cli_argv(tree: Path, case: str) -> list[str]:
    if case == "import moeviz":
        return [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(tree)!r}); import moeviz"]
    args = {"report (short prompt)": ["report", "--model", SAMPLE, "--text", PROMPT]}.get(case, case.split())
    return [sys.executable, "-c", LAUNCH.format(tree=str(tree)), *args]


def compiled(tree: Path) -> None:
    """moeviz and the app of `tree` byte-compiled, as pip compiles what it installs and Python caches what
    it imports (unless PYTHONDONTWRITEBYTECODE is set, as on the shared test machine: every process would
    then compile each module again, which a user's does not)."""
    folders = [str(tree / name) for name in ("moeviz", "app")]
    command = [sys.executable, "-m", "compileall", "-q", *folders]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)


def check_tree(tree: Path) -> None:
    """The launcher imports moeviz from `tree`, not from the installed copy."""
    compiled(tree)
    code = f"import sys; sys.path.insert(0, {str(tree)!r}); import moeviz; print(moeviz.__file__)"
    where = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, check=True)
    if not Path(where.stdout.strip()).is_relative_to(tree):
        raise SystemExit(f"moeviz came from {where.stdout.strip()}, not from {tree}")


def rounds(contenders: dict[str, Callable[[], tuple[float, float]]], repeats: int) -> dict[str, Samples]:
    """Each contender once per round, the order rotated by one each round."""
    names = list(contenders)
    samples = {name: Samples() for name in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            wall, cpu = contenders[name]()
            samples[name].wall.append(wall)
            samples[name].cpu.append(cpu)
    return samples


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):7.3f} ({min(values):.3f}–{max(values):.3f})"


def print_table(samples: dict[str, Samples], peer_of: dict[str, str]) -> None:
    print(f"{'contender':44} {'wall s, median (min–max)':>26} {'CPU s, median (min–max)':>26}  CPU ÷ peer")
    for name, got in samples.items():
        peer = samples.get(peer_of.get(name, ""))
        ratio = f"{statistics.median(got.cpu) / statistics.median(peer.cpu):.3f}" if peer else ""
        print(f"{name:44} {spread(got.wall):>26} {spread(got.cpu):>26}  {ratio}")


def bench_cli(base: Path | None, repeats: int, command: str) -> list[Figure]:
    trees = {"this checkout": REPO, **({"previous version": base} if base else {})}
    for tree in trees.values():
        check_tree(tree)
    contenders: dict[str, Callable[[], tuple[float, float]]] = {}
    peer_of = {}
    for case, peer in CLI_CASES.items():
        for label, tree in trees.items():
            name = f"{case} [{label}]"
            contenders[name] = lambda tree=tree, case=case: timed_process(cli_argv(tree, case))
            peer_of[name] = f"peer: {peer}"
    contenders["peer: python -c pass"] = lambda: timed_process([sys.executable, "-c", "pass"])
    for peer, code in PEERS.items():
        contenders[f"peer: {peer}"] = lambda code=code: timed_process([sys.executable, "-c", code])
    print(f"CLI: {repeats} rounds, each command in a fresh interpreter")
    samples = rounds(contenders, repeats)
    print_table(samples, peer_of)
    figures = []
    for name, got in samples.items():
        peer = samples.get(peer_of.get(name, ""))
        beside = ""
        if peer:
            ratio = statistics.median(got.cpu) / statistics.median(peer.cpu)
            beside = f"; {ratio:.3f}× the CPU of `{peer_of[name].removeprefix('peer: ')}`"
        what = f"`moeviz {name}`" if not name.startswith(("peer:", "import moeviz")) else f"`{name}`"
        figures.append(
            Figure(
                "Start-up",
                f"{what}, a fresh interpreter",
                f"CPU {spread(got.cpu).strip()} s, wall {spread(got.wall).strip()} s{beside}",
                command,
            )
        )
    return figures


# ---- the app's first page ------------------------------------------------------------------------------
FIRST_PAGE_S = 3.0  # issue 31: the app's first page within this after the server is up
FIRST_PAINT = "h1"  # the page's title: the first thing of the page drawn
OWN_WIDGETS = '[data-testid="stRadio"]'  # the Routing page's input picker: drawn by the page itself
# The page's views on the 8-expert sample: strip, heatmap, the token's scores, path and margin, load, expert
# timeline; the token's attention row (its own chart) follows them (on a start before torch, later).
VIEWS = 7
VIEWS_DRAWN = f"""() => {{
  const views = [...document.querySelectorAll('.vega-embed')]
    .filter(e => !e.closest('.st-key-token_attention'));
  return views.length >= {VIEWS} && views.every(e => e.querySelector('canvas, svg.marks'));
}}"""


def server_cpu(pid: int) -> float:
    """CPU seconds (user + system) the process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def entry_script(tree: Path) -> str:
    """What `moeviz app` runs in `tree`: app/serve.py, or app/streamlit_app.py in a version before it."""
    return "app/serve.py" if (tree / "app" / "serve.py").is_file() else "app/streamlit_app.py"


def first_page(tree: Path, browser, cache: Path | None) -> dict[str, float]:
    """A new server from `tree` on a free port, keeping what it keeps in `cache` (None: keeping off); once
    healthy, seconds from opening its URL to each milestone of the Routing page's first run, and the
    server's CPU seconds up to its end."""
    from moeviz.cli import APP_FLAGS
    from tests.support.browser import charts_drawn, runs, wait_until_idle, watch
    from tests.support.server import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [
        *(sys.executable, "-m", "streamlit", "run", entry_script(tree), "--server.headless", "true"),
        *("--server.port", str(port), "--server.address", "127.0.0.1", "--server.fileWatcherType", "none"),
        *APP_FLAGS,
    ]
    env = {
        **ENV,
        "MOEVIZ_DEFAULT_MODEL": SAMPLE,
        "PYTHONPATH": str(tree),
        "MOEVIZ_CACHE_DIR": str(cache or ""),
    }
    for name in ("MOEVIZ_MODEL_DIRS", "MOEVIZ_SAMPLE_MODELS"):
        env.pop(name, None)
    with tempfile.TemporaryFile() as log:
        launched = time.perf_counter()
        server = subprocess.Popen(command, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(url, server, log)
            first_browser = browser.new_context(viewport=VIEWPORT)
            page = watch(first_browser.new_page())
            start = time.perf_counter()
            page.goto(url, wait_until="commit")
            milestones = {"server up (from launch)": start - launched}
            for name, selector in (("first paint", FIRST_PAINT), ("own widgets", OWN_WIDGETS)):
                page.wait_for_selector(selector, timeout=300_000)
                milestones[name] = time.perf_counter() - start
            page.wait_for_function(VIEWS_DRAWN, timeout=300_000)
            milestones["views drawn"] = time.perf_counter() - start
            milestones["launch to views drawn"] = time.perf_counter() - launched
            milestones["server CPU"] = server_cpu(server.pid)
            page.get_by_text("Attention of", exact=False).first.wait_for(timeout=300_000)
            milestones["attention row"] = time.perf_counter() - start
            runs(page).wait_for_runs(0, timeout_s=300)
            wait_until_idle(page, 300)
            charts_drawn(page, 300)
            milestones["run done, every chart drawn"] = time.perf_counter() - start
            page.close()
            # the same page for a second session: nothing left to import, load or read (the browser's part),
            # in a new browser (its cache empty), then in the first one (Streamlit's scripts cached)
            for name, context in (("new", browser.new_context(viewport=VIEWPORT)), ("same", first_browser)):
                page = watch(context.new_page())
                again = time.perf_counter()
                page.goto(url, wait_until="commit")
                page.wait_for_function(VIEWS_DRAWN, timeout=300_000)
                milestones[f"second session, {name} browser: views drawn"] = time.perf_counter() - again
                context.close()
            return milestones
        finally:
            server.terminate()
            server.wait(timeout=30)


def wait_healthy(url: str, server: subprocess.Popen, log, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            log.seek(0)
            raise SystemExit(f"streamlit exited:\n{log.read().decode(errors='replace')[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as response:
                if response.read().strip() == b"ok":
                    return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"streamlit not healthy after {timeout_s} s")


# each start's name -> whether keeping is on (a new cache folder per repeat, shared by its starts)
STARTS = {
    "first start (new install: nothing kept)": True,
    "later start (example kept)": True,
    "keeping off (the example captured)": False,
}
VIEWPORT = {"width": 1200, "height": 1000}


def bench_app(base: Path | None, repeats: int, command: str) -> list[Figure]:
    from playwright.sync_api import sync_playwright

    from tests.support.server import CHROMIUM, CHROMIUM_ARGS

    trees = {"this checkout": REPO, **({"previous version": base} if base else {})}
    for tree in trees.values():
        compiled(tree)
    results: dict[tuple[str, str], list[dict[str, float]]] = {(t, s): [] for t in trees for s in STARTS}
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        labels = list(trees)
        for r in range(repeats):
            for label in labels[r % len(labels) :] + labels[: r % len(labels)]:
                with tempfile.TemporaryDirectory() as cache:
                    for start, keeping in STARTS.items():
                        kept = Path(cache) if keeping else None
                        results[label, start].append(first_page(trees[label], browser, kept))
        browser.close()
    print(
        f"\nApp: the Routing page's first run on a new server, {repeats} × {len(STARTS)} servers per version"
    )
    first = results[labels[0], next(iter(STARTS))][0]
    print(f"{'version, start':44} " + " ".join(f"{m + ' s':>24}" for m in first))
    figures = []
    for (label, start), runs_of in results.items():
        cells = [spread([run[m] for run in runs_of]) for m in runs_of[0]]
        print(f"{label + ', ' + start:44} " + " ".join(f"{c:>24}" for c in cells))
        drawn = statistics.median(run["views drawn"] for run in runs_of)
        figures.append(
            Figure(
                "Start-up",
                f"the app's Routing page on a new server, {start}, default sample, real Chromium [{label}]",
                "; ".join(f"{m} {cell.strip()} s" for m, cell in zip(runs_of[0], cells, strict=True)),
                command,
                target=f"first page (views drawn) < {FIRST_PAGE_S:g} s",
                met=drawn < FIRST_PAGE_S,
            )
        )
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, help="a checkout of the previous version to compare with")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--app", action="store_true", help="also the app's first page (Chromium)")
    parser.add_argument("--no-cli", action="store_true", help="only the app")
    args = parser.parse_args()
    base = args.base.resolve() if args.base else None
    sys.path.insert(0, str(REPO))  # the browser helpers live with the tests
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    command = f"python benchmarks/bench_startup.py{flags(parser, args)}"
    # one results file per part: a run of one part leaves the other's figures as they were measured
    if not args.no_cli:
        record("startup", bench_cli(base, args.repeats, command), render=not args.app)
    if args.app:
        record("startup_app", bench_app(base, args.repeats, command))
    print(f"load average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
