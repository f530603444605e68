"""Configuration: every `MOEVIZ_*` setting is read in moeviz.settings (on each call) and documented in the
README, and a checkout finds its app, sample models and docs in its top-level folders. The wheel and a
fresh interpreter's environment: tests/system/test_packaging.py."""

from __future__ import annotations

import os
import re
from pathlib import Path

from moeviz.models.loading import list_samples, sample_models_dir
from moeviz.resources import bundled_path
from moeviz.settings import SETTINGS_HELP, current_settings

REPO = Path(__file__).resolve().parents[2]


def test_settings_are_read_in_one_place_and_documented():
    readers = re.compile(r"""(environ(\.get)?|getenv)\s*[\[(]\s*["']MOEVIZ_""")
    offenders = [
        str(path.relative_to(REPO))
        for folder in ("moeviz", "app")
        for path in (REPO / folder).rglob("*.py")
        if path != REPO / "moeviz" / "settings.py" and readers.search(path.read_text(encoding="utf-8"))
    ]
    assert offenders == [], "read MOEVIZ_* settings through moeviz.settings.current_settings()"
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    table = {m.group(1) for m in re.finditer(r"^\| `(MOEVIZ_[A-Z_]+)` \|", readme, re.MULTILINE)}
    assert set(SETTINGS_HELP) <= table, set(SETTINGS_HELP) - table


def test_settings_are_read_on_each_call(monkeypatch, tmp_path):
    monkeypatch.setenv("MOEVIZ_SAMPLE_MODELS", str(tmp_path))
    monkeypatch.setenv("MOEVIZ_MODEL_DIRS", os.pathsep.join([str(tmp_path), " "]))
    monkeypatch.setenv("MOEVIZ_DEFAULT_MODEL", " sample:mixtral-collapsed ")
    monkeypatch.delenv("MOEVIZ_STORE_DIRS", raising=False)
    settings = current_settings()
    assert settings.model_dirs == (tmp_path.resolve(),) and settings.store_dirs is None
    assert settings.default_model == "sample:mixtral-collapsed"
    assert sample_models_dir() == tmp_path and list_samples() == []
    monkeypatch.delenv("MOEVIZ_SAMPLE_MODELS")
    assert sample_models_dir() == bundled_path("sample_models")


def test_checkout_uses_its_top_level_folders(monkeypatch):
    monkeypatch.delenv("MOEVIZ_SAMPLE_MODELS", raising=False)
    assert bundled_path("app") == REPO / "app"
    assert bundled_path("sample_models") == REPO / "sample_models"
    assert bundled_path("docs") == REPO / "docs"
    assert "mixtral-healthy" in list_samples()
