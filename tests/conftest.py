"""Shared fixtures: tiny random models of every family saved to disk, the bundled sample, and the browser."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """`tiny_model_dir(family, **overrides)` -> folder of a saved tiny model (built once per session)."""
    from moeviz.testing.tiny_models import save_tiny_model

    cache: dict[tuple, Path] = {}

    def make(family: str, **overrides) -> Path:
        key = (family, tuple(sorted(overrides.items())))
        if key not in cache:
            folder = tmp_path_factory.mktemp(family.replace("-", "_"))
            cache[key] = save_tiny_model(family, folder, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def sample_model():
    import moeviz

    return moeviz.load_model("sample:mixtral-healthy")


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A small corpus folder for the store tests: two domains, three documents each (1,500 characters of
    the sample evaluation slices), a few batches of ≤ 4 × 96 tokens."""
    from moeviz.samples import eval_dir

    root = tmp_path_factory.mktemp("corpus")
    for domain in ("python", "bible_en"):
        text = (eval_dir() / f"{domain}.txt").read_text(encoding="utf-8")
        (root / domain).mkdir()
        for i in range(3):
            (root / domain / f"doc{i}.txt").write_text(text[i * 1500 : (i + 1) * 1500], encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def browser():
    """Debian's headless Chromium for one module's browser tests (a missing browser fails the test: in CI
    the browser tests must run, never skip)."""
    from playwright.sync_api import sync_playwright

    from tests.app_server import CHROMIUM, CHROMIUM_ARGS

    if not CHROMIUM.is_file():
        pytest.fail(f"{CHROMIUM} not found: the browser tests need Debian's chromium (apt-get install it)")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        try:
            yield chromium
        finally:
            chromium.close()
