"""The Errors page (docs/errors.md) has a section for every `MoevizError` subclass defined anywhere in
moeviz: found in the source, so a new error class cannot be added without its cause and fix."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import moeviz.errors

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "errors.md"


def error_classes(*folders: Path) -> set[str]:
    """Names of the classes under `folders` that derive, directly or not, from MoevizError (by base name)."""
    bases: dict[str, set[str]] = {}
    for path in (path for folder in folders for path in folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                names = {
                    base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")
                    for base in node.bases
                }
                bases.setdefault(node.name, set()).update(names)
    found = {"MoevizError"}
    while grown := {name for name, parents in bases.items() if parents & found} - found:
        found |= grown
    return found


def documented(page: str) -> set[str]:
    return set(re.findall(r"^#+ `(\w+)`\s*$", page, re.MULTILINE))


def test_every_moeviz_error_has_a_section_with_cause_and_fix():
    classes = error_classes(ROOT / "moeviz")
    page = PAGE.read_text(encoding="utf-8")
    assert classes - documented(page) == set()
    for name in classes - {"MoevizError", "ModelSourceError"}:  # the bases say what they group
        section = page.split(f"`{name}`\n", 1)[1].split("\n#", 1)[0]
        assert "**Cause**" in section and "**Fix**" in section, name


def test_the_source_scan_finds_what_python_finds():
    runtime = {cls.__name__ for cls in vars(moeviz.errors).values() if isinstance(cls, type)}
    assert runtime <= error_classes(ROOT / "moeviz")
    assert {"LabBusy", "InterventionError", "NoEffectError", "VllmError"} <= error_classes(ROOT / "moeviz")


def test_a_missing_section_is_caught(tmp_path):
    (tmp_path / "new.py").write_text(
        "from moeviz.errors import StoreError\nclass ShinyError(StoreError): ...\n"
    )
    assert "ShinyError" in error_classes(ROOT / "moeviz", tmp_path)
    assert "ShinyError" not in documented(PAGE.read_text(encoding="utf-8"))
