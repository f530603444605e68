"""Write the family table of `moeviz.models.families` into docs/families.md (the site's "Supported families"
page), between its family-table markers; the prose around the markers is hand-written.

python scripts/family_table.py          # rewrite docs/families.md
python scripts/family_table.py --check  # exit 1 when docs/families.md is stale
"""

from __future__ import annotations

import sys
from pathlib import Path

from moeviz.models.families import markdown_table

PAGE = Path(__file__).resolve().parent.parent / "docs" / "families.md"
START, END = "<!-- family-table:start -->", "<!-- family-table:end -->"


def render(text: str) -> str:
    """`text` with the part between the markers replaced by the current table."""
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{markdown_table()}\n{END}{tail}"


def main(argv: list[str]) -> int:
    text = PAGE.read_text(encoding="utf-8")
    fresh = render(text)
    if "--check" in argv:
        if fresh != text:
            print(f"{PAGE.name}'s family table is stale: run python scripts/family_table.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(fresh, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
