"""Every icon the app sets is one of Streamlit's Material icons: emoji render as empty boxes on machines
without an emoji font (servers, kiosks, projectors)."""

from __future__ import annotations

import ast
from pathlib import Path

APP = Path(__file__).resolve().parents[2] / "app"


def icons() -> list[tuple[str, int, str]]:
    """(file, line, value) of every string passed as `icon=` or `page_icon=` anywhere under app/."""
    found = []
    for path in sorted(APP.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            named = isinstance(node, ast.keyword) and node.arg in ("icon", "page_icon")
            if named and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                found.append((str(path.relative_to(APP)), node.lineno, node.value.value))
    return found


def test_the_app_sets_icons() -> None:
    files = {file for file, _, _ in icons()}
    assert "streamlit_app.py" in files  # the navigation's icons are among those checked


def test_every_icon_is_a_material_icon() -> None:
    emoji = [(file, line, value) for file, line, value in icons() if not value.startswith(":material/")]
    assert not emoji, f"icons that need an emoji font: {emoji}"
