"""Sections of the project's documentation shown in the app (read from the checkout). No Streamlit here."""

from __future__ import annotations

from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"


def verdict_rule() -> str:
    """The rule, null and sample-size sections of docs/verdicts.md ("" when the docs are not installed)."""
    path = DOCS / "verdicts.md"
    if not path.is_file():
        return ""
    text = path.read_text(encoding="utf-8")
    start, end = text.find("## The rule"), text.find("## Measured false-alarm rates")
    return text[start : end if end > start else None].strip() if start >= 0 else ""
