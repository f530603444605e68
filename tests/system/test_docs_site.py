"""The documentation site builds without a single warning (`mkdocs build --strict`: a broken link or
anchor, a page missing from the nav, a docstring mkdocstrings cannot render), and the pages that mirror the
code stay true to it: the Architecture page's layers are the import contract's, and the README keeps the
test command CI runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_site_builds_strictly_without_warnings(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "HF_HUB_OFFLINE": "1"}
    build = [
        sys.executable,
        "-m",
        "mkdocs",
        "build",
        "--strict",
        "-f",
        "mkdocs.yml",
        "-d",
        str(tmp_path / "site"),
    ]
    result = subprocess.run(build, cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    output = result.stdout + result.stderr
    warnings = [line for line in output.splitlines() if "WARNING" in line or "ERROR" in line]
    assert result.returncode == 0 and warnings == [], output[-4000:]
    for page in ("index", "cli", "families", "errors", "api", "benchmarks", "changelog"):
        assert (tmp_path / "site" / ("" if page == "index" else page) / "index.html").is_file(), page
    api = (tmp_path / "site" / "api" / "index.html").read_text(encoding="utf-8")
    assert 'id="moeviz.load_model"' in api and 'id="moeviz.Trace.routing_frame"' in api


def test_every_doc_page_is_in_the_nav():
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    nav = set(re.findall(r":\s*([\w./-]+\.md)\s*$", config, re.MULTILINE))
    pages = {path.relative_to(ROOT / "docs").as_posix() for path in (ROOT / "docs").rglob("*.md")}
    assert pages == nav


def test_the_architecture_page_lists_the_layers_of_the_import_contract():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    contract = next(c for c in config["tool"]["importlinter"]["contracts"] if c["id"] == "layers")
    expected = [
        (depth, name.strip())
        for depth, layer in enumerate(contract["layers"], start=1)
        for name in layer.split("|")
    ]
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    rows = [(int(d), name) for d, name in re.findall(r"^\| (\d+) \| `moeviz\.(\w+)` \|", page, re.MULTILINE)]
    assert rows == expected


def test_the_readme_is_short_and_keeps_the_command_ci_runs():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 150
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").strip().splitlines()[-1].strip()
    assert ci == "make test" and re.search(rf"^{re.escape(ci)}\s+#", readme, re.MULTILINE)
