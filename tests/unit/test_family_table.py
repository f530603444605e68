"""The site's family table (docs/families.md) is the one `moeviz.models.families` generates, and the
table is coherent."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from moeviz.models.decoding import DECODERS
from moeviz.models.families import FAMILIES, SUBMODELS, SUPPORT_LEVELS, markdown_table, refusal
from moeviz.scoring import SCORE_FUNCTIONS

ROOT = Path(__file__).resolve().parents[2]


def test_the_families_page_holds_the_generated_family_table():
    page = (ROOT / "docs" / "families.md").read_text(encoding="utf-8")
    assert markdown_table() in page
    check = [sys.executable, str(ROOT / "scripts" / "family_table.py"), "--check"]
    assert subprocess.run(check, cwd=ROOT, capture_output=True).returncode == 0


def test_a_stale_table_is_caught(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import family_table
    finally:
        sys.path.pop(0)
    stale = tmp_path / "families.md"
    stale.write_text(f"x\n{family_table.START}\n| old |\n{family_table.END}\ny\n", encoding="utf-8")
    monkeypatch.setattr(family_table, "PAGE", stale)
    assert family_table.main(["--check"]) == 1
    assert family_table.main([]) == 0 and markdown_table() in stale.read_text(encoding="utf-8")
    assert family_table.main(["--check"]) == 0


def test_every_row_names_a_known_rule():
    for model_type, row in FAMILIES.items():
        assert row.support in SUPPORT_LEVELS, model_type
        assert row.decoder in DECODERS or row.decoder == "auto", model_type
        assert row.score_fn is None or row.score_fn in SCORE_FUNCTIONS, model_type
        assert row.bias_on in ("scores", "logits"), model_type
        if row.support == "refused" and model_type not in SUBMODELS:
            assert refusal(model_type) == row.note and row.note
    for sub, parent in SUBMODELS.items():
        assert FAMILIES[sub] is FAMILIES[parent] and parent not in SUBMODELS
        assert parent in refusal(sub)
