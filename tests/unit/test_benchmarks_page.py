"""The Benchmarks page (docs/benchmarks.md) is the one scripts/benchmarks_page.py renders from the results
files the benchmark scripts write (benchmarks/record.py), every recorded figure is on it under its section,
and a results file the page cannot trust is refused in one line."""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "benchmarks_page.py"
PAGE = ROOT / "docs" / "benchmarks.md"
RESULTS = ROOT / "benchmarks" / "results"


def _module(folder: str, name: str):
    sys.path.insert(0, str(ROOT / folder))
    try:
        return __import__(name)
    finally:
        sys.path.pop(0)


def _page_rows(page: str) -> set[tuple[str, ...]]:
    """(section, what, figure, target, command) of every table row, read from the Markdown itself."""
    rows, section = set(), ""
    for line in page.splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        elif line.startswith("| ") and not line.startswith(("| what |", "|---")):
            cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            what, figure, target, _met, command, _when = cells
            rows.add((section, what, figure, target, command.strip("`")))
    return rows


def _results_file(folder: Path, name: str = "demo", **changes) -> Path:
    data = {
        "bench": name,
        "date": "2026-01-02",
        "commit": "abc1234",
        "machine": "Test CPU, 2 cores, 8 GiB, Linux x86_64",
        "figures": [
            {
                "section": "Capture",
                "what": "capture vs plain | 512 tokens",
                "figure": "1.010× (1.000–1.020)",
                "command": "python benchmarks/bench_demo.py --tokens 512",
                "target": "≤ 1.03×",
                "met": True,
            }
        ],
    }
    data.update(changes)
    path = folder / f"{name}.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True)


def test_the_benchmarks_page_is_fresh():
    result = _run("--check")
    assert result.returncode == 0, result.stderr


def test_every_recorded_figure_is_on_the_page_under_its_section():
    recorded = set()
    for path in RESULTS.glob("*.json"):
        for f in json.loads(path.read_text(encoding="utf-8"))["figures"]:
            recorded.add((f["section"], f["what"], f["figure"], f.get("target", ""), f["command"]))
    assert recorded, "no results files"
    assert _page_rows(PAGE.read_text(encoding="utf-8")) == recorded


def test_a_stale_page_is_caught(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    _results_file(results)
    page = tmp_path / "page.md"
    assert _run("--check", "--results", str(results), "--page", str(page)).returncode == 1  # missing
    assert _run("--results", str(results), "--page", str(page)).returncode == 0
    written = page.read_text(encoding="utf-8")
    assert _page_rows(written) == {
        ("Capture", "capture vs plain | 512 tokens", "1.010× (1.000–1.020)", "≤ 1.03×",
         "python benchmarks/bench_demo.py --tokens 512")
    }  # fmt: skip
    assert "2026-01-02 · abc1234 · [M1](#machines)" in written
    assert "- **M1**: Test CPU, 2 cores, 8 GiB, Linux x86_64" in written
    assert _run("--check", "--results", str(results), "--page", str(page)).returncode == 0
    _results_file(results, "other", date="2026-01-03")  # a new benchmark's figures
    stale = _run("--check", "--results", str(results), "--page", str(page))
    assert stale.returncode == 1 and "stale" in stale.stderr
    assert page.read_text(encoding="utf-8") == written  # --check writes nothing


BAD = {
    "bad JSON": ('{"bench": "demo", ', "not valid JSON"),
    "missing commit": ({"commit": None}, "missing key 'commit'"),
    "missing figure command": ({"figures": [{"section": "S", "what": "w", "figure": "1 s"}]}, "'command'"),
    "met not a bool": (
        {"figures": [{"section": "S", "what": "w", "figure": "1 s", "command": "c", "met": "yes"}]},
        "'met' must be bool or NoneType",
    ),
    "unknown key": ({"machnie": "typo"}, "unknown key 'machnie'"),
    "bad date": ({"date": "02/12/2026"}, "'date' must be YYYY-MM-DD"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_a_bad_results_file_is_refused_in_one_line(tmp_path, case):
    content, message = BAD[case]
    results = tmp_path / "results"
    results.mkdir()
    _results_file(results, "good")
    if isinstance(content, str):
        (results / "broken.json").write_text(content, encoding="utf-8")
    else:
        path = _results_file(results, "broken")
        data = json.loads(path.read_text(encoding="utf-8"))
        data.update({k: v for k, v in content.items() if v is not None})
        for key in [k for k, v in content.items() if v is None]:
            del data[key]
        path.write_text(json.dumps(data), encoding="utf-8")
    page = tmp_path / "page.md"
    for args in ([], ["--check"]):
        result = _run(*args, "--results", str(results), "--page", str(page))
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1, result.stderr
        assert "broken.json" in lines[0] and message in lines[0], lines[0]
        assert not page.exists()


def test_record_writes_a_file_the_page_renders(tmp_path, monkeypatch):
    record = _module("benchmarks", "record")
    monkeypatch.setattr(record, "RESULTS", tmp_path)
    figure = record.Figure("Analysis", "balance frames", "0.42 s (0.41–0.45)", "python b.py", "< 2 s", True)
    path = record.record("bench_measured", [figure], render=False)
    data = json.loads(path.read_text(encoding="utf-8"))
    assert path == tmp_path / "measured.json" and data["bench"] == "measured"  # one file per benchmark
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    assert data["date"] == datetime.now(UTC).strftime("%Y-%m-%d")
    assert data["commit"].rstrip("+") == head.stdout.strip()
    assert data["machine"] == record.machine() and "note" not in data
    carried = record.Figure("Capture", "old", "1.05×", "python c.py")
    record.record(
        "carried",
        [carried],
        render=False,
        date="2025-11-30",
        commit="fbd3f53",
        machine_line="M",
        note="from X",
    )
    page = _module("scripts", "benchmarks_page").render(tmp_path)
    assert _page_rows(page) == {
        ("Analysis", "balance frames", "0.42 s (0.41–0.45)", "< 2 s", "python b.py"),
        ("Capture", "old", "1.05×", "", "python c.py"),
    }
    # files in name order: "carried" is the first, its machine M1
    assert "2025-11-30 · fbd3f53 · [M1](#machines) · [carried over](#carried-over-figures)" in page
    assert "- `carried`: from X" in page and "- **M1**: M\n" in page


def test_flags_give_back_the_arguments_that_ran():
    flags = _module("benchmarks", "record").flags
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--models", default="sample,mid")
    parser.add_argument("--app", action="store_true")
    parser.add_argument("--base", type=Path)
    for argv in ([], ["--tokens", "256"], ["--app", "--models", "mid", "--base", "/tmp/x"]):
        args = parser.parse_args(argv)
        tail = flags(parser, args)
        assert parser.parse_args(shlex.split(tail)) == args, tail
        assert bool(tail) == bool(argv)
