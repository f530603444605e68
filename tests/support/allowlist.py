"""The allowed folders of the hardening tests (`MOEVIZ_MODEL_DIRS`, `MOEVIZ_STORE_DIRS`): an allowed folder
and one outside it holding a secret file, and copies of a tiny model to put in either; `allowlist_fixtures`
gives a test module all three as fixtures (tests/models/test_hardening_allowlist.py,
tests/app/test_allowlist_pages.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.support.app import app_test_env

SECRET = "hunter2-SECRET-TOKEN"


def make_roots(tmp_path: Path, monkeypatch) -> tuple[Path, Path]:
    """(allowed, outside): MOEVIZ_MODEL_DIRS and MOEVIZ_STORE_DIRS = allowed; outside/secret.txt = SECRET."""
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    (outside / "secret.txt").write_text(SECRET)
    monkeypatch.setenv("MOEVIZ_MODEL_DIRS", str(allowed))
    monkeypatch.setenv("MOEVIZ_STORE_DIRS", str(allowed))
    return allowed, outside


def model_copier(tiny_model_dir):
    """`make(parent, name="m")` -> a copy of the tiny Mixtral folder at parent/name."""

    def make(parent: Path, name: str = "m") -> Path:
        return shutil.copytree(tiny_model_dir("mixtral"), parent / name)

    return make


def allowlist_fixtures():
    """The fixtures of a test module on the allowed folders, bound by name in the module
    (`_app_env, roots, model_in = allowlist_fixtures()`): `_app_env` (autouse: the app's environment,
    `app_test_env`), `roots` (`make_roots`: (allowed, outside)) and `model_in` (`model_copier`)."""

    @pytest.fixture(autouse=True)
    def _app_env(monkeypatch):
        app_test_env(monkeypatch)

    @pytest.fixture
    def roots(tmp_path, monkeypatch):
        return make_roots(tmp_path, monkeypatch)

    @pytest.fixture
    def model_in(tiny_model_dir):
        return model_copier(tiny_model_dir)

    return _app_env, roots, model_in
