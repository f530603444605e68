"""Packaging: the wheel ships the app, the samples and the docs the app reads; importing moeviz in a fresh
interpreter leaves the environment alone. The `MOEVIZ_*` settings: tests/unit/test_settings.py.

The whole check of an installed wheel (a fresh venv outside the checkout, `moeviz report` and `moeviz app`
on the default sample) takes minutes: scripts/check_wheel.sh.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.support.app import app_importable

REPO = Path(__file__).resolve().parents[2]


def app_docs_files() -> list[Path]:
    """The files of docs/ the app reads (app/components/docs.py, imported as the pages import it)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        app_importable(monkeypatch)
        from components import docs

        return [docs.VERDICTS, docs.DEPLOYMENT_WHATIFS, docs.EXPERTS_SWEEP]


def test_importing_moeviz_leaves_the_environment_alone():
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    code = (
        "import os; before = dict(os.environ)\n"
        "import moeviz, moeviz.cli, moeviz.store, moeviz.analysis, moeviz.charts, moeviz.report\n"
        "changed = sorted(set(os.environ.items()) ^ set(before.items()))\n"
        "assert not changed, changed\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]


def test_wheel_ships_the_app_the_samples_and_the_docs_the_app_reads(tmp_path):
    """Build the wheel from a clean copy of the tree (no stale build/ folder) and read its file list."""
    source = tmp_path / "src"
    shutil.copytree(
        REPO,
        source,
        ignore=shutil.ignore_patterns(
            ".git",
            ".venv",
            ".venv-vllm",
            "build",
            "dist",
            "*.egg-info",
            "__pycache__",
            ".*_cache",
            "screenshots",
            "benchmarks",
        ),
    )
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w"]
    build = subprocess.run(
        [*command, str(tmp_path), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = tmp_path.glob("moeviz-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())

    def shipped(folder: str, inside: str) -> set[str]:
        files = (p for p in (REPO / folder).rglob("*") if p.is_file() and "__pycache__" not in p.parts)
        return {f"moeviz/{inside}/{p.relative_to(REPO / folder).as_posix()}" for p in files}

    app, samples = shipped("app", "_app"), shipped("sample_models", "_sample_models")
    assert {"moeviz/_app/streamlit_app.py", "moeviz/_app/serve.py"} <= app
    assert any("/_app/pages/" in n for n in app)
    assert "moeviz/_sample_models/mixtral-healthy/model.safetensors" in samples
    assert "moeviz/_sample_models/mixtral-healthy/tokenizer.json" in samples
    assert "moeviz/_sample_models/examples/manifest.json" in samples  # the first page's routing
    assert app | samples <= names, sorted((app | samples) - names)[:10]
    # of docs/, exactly the files the app reads: no screenshots, no other page
    docs = {n for n in names if n.startswith("moeviz/_docs/")}
    assert docs == {f"moeviz/_docs/{path.relative_to(REPO / 'docs').as_posix()}" for path in app_docs_files()}
    assert {"moeviz/__init__.py", "moeviz/cli/__init__.py", "moeviz/testing/tiny_models.py"} <= names
    assert "moeviz/py.typed" in names  # PEP 561: type checkers read the installed package's annotations
    assert not [n for n in names if n.startswith(("tests/", "app/", "sample_models/")) or "__pycache__" in n]
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "moeviz = moeviz.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
