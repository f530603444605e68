"""Where a benchmark's figures go: `record(bench, rows)` writes `benchmarks/results/<bench>.json` with the
date, the commit and the machine, and the Benchmarks page (`docs/benchmarks.md`) is rendered from every
results file by `scripts/benchmarks_page.py` — no figure is copied by hand.

A row is one figure: `Figure(section, what, figure, command, target="", met=None)`, `figure` the text as the
page shows it (median, spread in brackets, the peer's figure beside it).

A figure not measured by this checkout (one carried over from an earlier page, a benchmark whose environment
is missing) is recorded with its own `date`, `commit` and `machine` and a `note` saying where it comes from;
the page shows the note.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


@dataclass(frozen=True)
class Figure:
    """One measured figure as the Benchmarks page shows it."""

    section: str  # the page's heading it goes under, e.g. "Capture"
    what: str  # what was measured, with the size ("routing capture vs a plain forward, 512 tokens")
    figure: str  # the measured value as text: "1.05× (1.02–1.08)"
    command: str  # the command that reproduces it
    target: str = ""  # the target from the issue, if one was named
    met: bool | None = None  # None: no target


def _commit() -> str:
    """The checkout's short commit, with `+` when the tree has uncommitted changes."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+" if dirty else "")


def machine() -> str:
    """The machine in one line: CPU model, cores this process may use, memory, OS."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    memory = ""
    try:
        total_kib = int(Path("/proc/meminfo").read_text().split()[1])
        memory = f", {total_kib / 2**20:.0f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    return f"{cpu}, {cores} cores{memory}, {platform.system()} {platform.machine()}"


def flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """The options of `args` that differ from the parser's defaults, as a command line tail (" --tokens
    256"), so a figure's command is the one that measured it."""
    parts: list[str] = []
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", argparse.SUPPRESS):
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flag = action.option_strings[-1]
        if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
            parts.append(flag)
        elif isinstance(value, list | tuple):
            parts.append(f"{flag} {' '.join(str(item) for item in value)}")
        else:
            parts.append(f"{flag} {value}")
    return "".join(f" {part}" for part in parts)


def record(
    bench: str,
    figures: list[Figure],
    *,
    render: bool = True,
    date: str | None = None,
    commit: str | None = None,
    machine_line: str | None = None,
    note: str = "",
) -> Path:
    """Write `benchmarks/results/<bench>.json` (`bench` without a leading "bench_"; replacing that
    benchmark's previous figures) and, with `render`, re-render `docs/benchmarks.md` from every results
    file. → the results file.

    `date`, `commit`, `machine_line` default to now, this checkout and this machine; pass them (with a
    `note` saying why) only for figures measured elsewhere or earlier."""
    bench = bench.removeprefix("bench_")  # "bench_attention" and "attention" are one benchmark, one file
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{bench}.json"
    payload: dict[str, object] = {
        "bench": bench,
        "date": date or datetime.now(UTC).strftime("%Y-%m-%d"),
        "commit": commit or _commit(),
        "machine": machine_line or machine(),
        "figures": [asdict(figure) for figure in figures],
    }
    if note:
        payload["note"] = note
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=1, ensure_ascii=False) + "\n")
    tmp.replace(path)
    if render:
        subprocess.run([sys.executable, str(REPO / "scripts" / "benchmarks_page.py")], cwd=REPO, check=False)
    return path
