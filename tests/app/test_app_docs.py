"""The documentation the app shows (app/components/docs.py): the files are there (the wheel ships them, see
tests/system/test_packaging.py), and every heading the app cuts a section out of them by exists in them, so
that no page silently shows nothing: the verdict rule's start and end on the Load page, every section a
Deployment tab opens (`definitions(<heading>, ...)` in app/), and the experts sweep the Learn page draws."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support.app import APP_DIR, app_importable


@pytest.fixture
def docs(monkeypatch):
    app_importable(monkeypatch)
    from components import docs

    return docs


def deployment_headings() -> list[str]:
    """The first argument of every `definitions("<heading>", ...)` call in the app's code."""
    headings = []
    for path in sorted(APP_DIR.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", getattr(node.func, "id", None)) == "definitions"
                and node.args
            ):
                assert isinstance(node.args[0], ast.Constant), f"{path.name}: a heading the test cannot read"
                headings.append(node.args[0].value)
    return headings


def test_the_docs_the_app_reads_are_there(docs):
    repo = Path(__file__).resolve().parents[2]
    assert repo / "docs" == docs.DOCS  # a checkout reads its own docs/
    for path in (docs.VERDICTS, docs.DEPLOYMENT_WHATIFS, docs.EXPERTS_SWEEP):
        assert path.is_file(), path


def test_the_verdict_rule_markers_exist_in_order(docs):
    text = docs.VERDICTS.read_text(encoding="utf-8")
    lines = text.splitlines()
    assert docs.VERDICT_RULE_FROM in lines and docs.VERDICT_RULE_TO in lines
    assert text.index(docs.VERDICT_RULE_FROM) < text.index(docs.VERDICT_RULE_TO)
    rule = docs.verdict_rule()
    assert rule.startswith(docs.VERDICT_RULE_FROM) and docs.VERDICT_RULE_TO not in rule


def test_every_deployment_section_the_app_opens_exists(docs):
    headings = deployment_headings()
    assert {"Expert parallelism", "Offloading", "Capacity", "Quantisation", "Model size"} <= set(headings)
    titles = [
        line[3:].lower()
        for line in docs.DEPLOYMENT_WHATIFS.read_text(encoding="utf-8").splitlines()
        if line.startswith("## ")
    ]
    for heading in headings:
        assert any(heading.lower() in title for title in titles), (heading, titles)
        section = docs.deployment_section(heading)
        assert section.startswith("#### ") and heading.lower() in section.partition("\n")[0].lower()
    assert docs.deployment_section("no such section") == ""


def test_the_experts_sweep_is_read(docs):
    from components import learn

    assert learn.SWEEP == docs.EXPERTS_SWEEP
    sweep = learn.experts_sweep()
    assert sweep is not None and {"experts", "k", "heldout_loss"} <= set(sweep.columns)
