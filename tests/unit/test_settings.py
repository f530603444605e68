"""Configuration: every `MOEVIZ_*` setting is read in moeviz.settings (on each call) and documented in the
site's Settings table (docs/index.md), and a checkout finds its app, sample models and docs in its top-level
folders. The wheel and a fresh interpreter's environment: tests/system/test_packaging.py."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from moeviz.errors import SettingsError
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
    page = (REPO / "docs" / "index.md").read_text(encoding="utf-8")
    table = {m.group(1) for m in re.finditer(r"^\| `(MOEVIZ_[A-Z_]+)` \|", page, re.MULTILINE)}
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


@pytest.mark.parametrize("value", ["", ":", " ", os.pathsep.join(["", " "])])
def test_a_folder_list_set_but_empty_allows_no_folder(monkeypatch, value):
    monkeypatch.setenv("MOEVIZ_MODEL_DIRS", value)
    monkeypatch.setenv("MOEVIZ_STORE_DIRS", value)
    settings = current_settings()
    assert settings.model_dirs == () and settings.store_dirs == ()  # none allowed, not "any" (None)
    monkeypatch.delenv("MOEVIZ_MODEL_DIRS")
    assert current_settings().model_dirs is None


@pytest.mark.parametrize("value, expected", [("0", 0), ("3", 3), (" 2 ", 2), ("", None)])
def test_the_lab_limit_takes_whole_numbers_and_zero_disables_the_lab(monkeypatch, value, expected):
    from moeviz.lab import LabBusy, LabRunner, max_runs
    from moeviz.lab.config import LabConfig
    from moeviz.lab.runner import DEFAULT_MAX_RUNS

    monkeypatch.setenv("MOEVIZ_LAB_MAX_RUNS", value)
    assert current_settings().lab_max_runs == expected
    assert max_runs() == (DEFAULT_MAX_RUNS if expected is None else expected)
    if expected == 0:
        with pytest.raises(LabBusy, match="the Lab is disabled on this server"):
            LabRunner(LabConfig()).start()


@pytest.mark.parametrize("value", ["-1", "abc", "1.5", "1e3", "two"])
def test_an_unusable_lab_limit_is_an_error_not_the_default(monkeypatch, value):
    monkeypatch.setenv("MOEVIZ_LAB_MAX_RUNS", value)
    with pytest.raises(
        SettingsError, match=f"MOEVIZ_LAB_MAX_RUNS='{re.escape(value)}': expected a whole number"
    ):
        current_settings()
