"""Every ```python block of the README and the documentation site runs, on the sample models, offline.

A page's blocks run in order in one namespace, as a reader would type them into one session (a later block
may use `loaded` or `trace` from an earlier one), in a temporary working folder (examples write files such
as trace.parquet). A block may be skipped only with a reason on its fence: ```python title="not run: why".
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```python([^\n]*)\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)
NOT_RUN = re.compile(r'title="not run(?::\s*(?P<reason>[^"]*))?"')


def doc_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def python_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """(line, code, skip reason or None) of every ```python block of a page."""
    blocks = []
    for match in FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        skip = NOT_RUN.search(match.group(1))
        blocks.append((line, match.group(2), None if skip is None else (skip.group("reason") or "").strip()))
    return blocks


PAGES = [page for page in doc_pages() if python_blocks(page.read_text(encoding="utf-8"))]


def test_the_readme_and_the_library_guide_have_examples_to_run():
    names = {page.relative_to(ROOT).as_posix() for page in PAGES}
    assert {"README.md", "docs/library.md"} <= names


def test_a_skipped_block_needs_a_reason():
    assert python_blocks('```python title="not run: needs a GPU"\nx\n```\n')[0][2] == "needs a GPU"
    for page in doc_pages():
        for line, _, reason in python_blocks(page.read_text(encoding="utf-8")):
            assert reason is None or reason, f"{page.name}:{line}: a block marked 'not run' must say why"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(ROOT).as_posix())
def test_the_page_examples_run(page, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__doc_example__"}
    for line, code, reason in python_blocks(page.read_text(encoding="utf-8")):
        if reason is not None:
            continue
        try:
            exec(compile(code, f"{page.name}:{line}", "exec"), namespace)
        except Exception as error:
            pytest.fail(
                f"{page.relative_to(ROOT)}, the block at line {line}: {type(error).__name__}: {error}"
            )
