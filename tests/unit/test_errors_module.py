"""Every `MoevizError` subclass is defined in moeviz/errors.py (one place to read what moeviz can raise), and
the modules that raise one re-export it under its old import path."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import moeviz.errors

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "moeviz"
ERRORS = PACKAGE / "errors.py"


def error_classes_outside(errors_file: Path, *folders: Path) -> dict[str, str]:
    """Classes under `folders` (errors_file aside) that derive, directly or through other classes, from a
    class of `errors_file` rooted at MoevizError, by base name -> 'path:line'. Read from the source, so no
    module is imported."""
    bases: dict[str, set[str]] = {}
    where: dict[str, str] = {}
    for path in sorted(path for folder in folders for path in folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                names = {
                    base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")
                    for base in node.bases
                }
                bases.setdefault(node.name, set()).update(names)
                if path.resolve() != errors_file.resolve():
                    where[node.name] = f"{path.relative_to(path.parents[1])}:{node.lineno}"
    found = {"MoevizError"}
    while grown := {name for name, parents in bases.items() if parents & found} - found:
        found |= grown
    return {name: where[name] for name in sorted(found & where.keys())}


def test_every_moeviz_error_is_defined_in_errors_py():
    assert error_classes_outside(ERRORS, PACKAGE) == {}


def test_the_scan_sees_what_python_sees():
    """The source scan and the class objects agree on errors.py: every exception class there is rooted at
    MoevizError, and Python's subclass walk from MoevizError finds the same names."""

    def walk(cls: type) -> set[str]:
        return {cls.__name__}.union(*(walk(sub) for sub in cls.__subclasses__()))

    defined = {
        name
        for name, value in vars(moeviz.errors).items()
        if isinstance(value, type) and value.__module__ == "moeviz.errors"
    }
    assert defined <= walk(moeviz.errors.MoevizError)


def test_a_subclass_defined_elsewhere_is_caught(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "store.py").write_text(
        "from moeviz import errors\nfrom moeviz.errors import StoreError\n"
        "class ShinyError(StoreError): ...\nclass ShinierError(ShinyError): ...\n"
        "class Other(errors.InputError): ...\nclass Unrelated(ValueError): ...\n",
        encoding="utf-8",
    )
    assert set(error_classes_outside(ERRORS, PACKAGE, tmp_path)) == {"ShinyError", "ShinierError", "Other"}


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("moeviz.engines.layout", "LayoutError"),
        ("moeviz.engines.vllm", "VllmError"),
        ("moeviz.interventions.specs", "InterventionError"),
        ("moeviz.interventions.counterfactual", "NoEffectError"),
        ("moeviz.lab.runner", "LabBusy"),
        ("moeviz.lab.runner", "LabTooLarge"),
        ("moeviz.snippets", "SnippetError"),
    ],
)
def test_old_import_paths_still_work(module, name):
    assert getattr(importlib.import_module(module), name) is getattr(moeviz.errors, name)
