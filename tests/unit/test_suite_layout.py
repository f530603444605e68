"""The suite's shape (tests/conftest.py): every test file lives in a tier folder, and no test module imports
another (shared code is in tests/support)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
TIERS = ("unit", "models", "app", "browser", "system")


def test_every_test_file_is_in_a_tier() -> None:
    stray = [p.relative_to(TESTS).as_posix() for p in TESTS.rglob("test_*.py") if p.parent.name not in TIERS]
    assert not stray, f"test files outside tests/{{{','.join(TIERS)}}}: they would get no tier marker"


def test_no_test_module_imports_another() -> None:
    offenders = []
    for path in TESTS.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
                if node.level:  # a relative import: from .test_x import ...
                    names = [a.name for a in node.names] + [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            if any(part.startswith("test_") for name in names for part in name.split(".")):
                offenders.append(f"{path.relative_to(TESTS)}:{node.lineno}")
    assert not offenders, offenders
