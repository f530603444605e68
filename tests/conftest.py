"""Shared fixtures: tiny random models of every family saved to disk, and the bundled sample."""

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
