"""What the `moeviz` commands print on stdout, rendered one way.

JSON: `json_text`, always `moeviz.jsonable.dumps` (strict JSON: NaN and infinities become null, numpy values
Python ones). Tables: `text_table` (aligned columns) and `markdown_table`, from `Column`s and rows (dicts);
a frame's own columns by `frame_table`. Numbers without a format of their own follow one rule, `number`:
integers with thousands separators, floats to 4 significant digits. A missing value (NaN, None) is `MISSING`.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from moeviz.jsonable import dumps

MISSING = "–"
INTEGER = "{:,}"
FLOAT = "{:.4g}"


@dataclass(frozen=True)
class Column:
    """One column: the row key it shows, its header (default: the key), how a value is written, which side
    it aligns to ('>' right, '<' left) and its least width (a fixed layout; a wider cell widens it)."""

    key: str
    format: str = "{}"
    header: str | None = None
    align: str = ">"
    width: int = 0

    @property
    def title(self) -> str:
        return self.key if self.header is None else self.header


def json_text(payload: Any) -> str:
    """A JSON payload as the CLI prints it."""
    return dumps(payload)


def is_missing(value: Any) -> bool:
    return value is None or (isinstance(value, numbers.Real) and value != value)


def cell(value: Any, format: str = "{}") -> str:
    return MISSING if is_missing(value) else format.format(value)


def number(value: Any) -> str:
    """A scalar without a format of its own (a total, a frame's cell): the one rule for numbers."""
    if is_missing(value):
        return MISSING
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return str(value)
    return INTEGER.format(value) if isinstance(value, numbers.Integral) else FLOAT.format(value)


def text_table(columns: Sequence[Column], rows: Iterable[Mapping[str, Any]], *, gap: int = 1) -> list[str]:
    """The header line and one line per row, each column as wide as its widest cell, `gap` spaces apart."""
    cells = [[cell(row[c.key], c.format) for c in columns] for row in rows]
    widths = [max(c.width, len(c.title), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]

    def line(texts: Sequence[str]) -> str:
        justified = (
            text.ljust(width) if c.align == "<" else text.rjust(width)
            for text, width, c in zip(texts, widths, columns, strict=True)
        )
        return (" " * gap).join(justified)

    return [line([c.title for c in columns]), *(line(r) for r in cells)]


def markdown_table(columns: Sequence[Column], rows: Iterable[Mapping[str, Any]]) -> list[str]:
    """The same table as Markdown (a header row, its rule, one row per row)."""
    out = ["| " + " | ".join(c.title for c in columns) + " |", "|" + "---|" * len(columns)]
    return out + ["| " + " | ".join(cell(row[c.key], c.format) for c in columns) + " |" for row in rows]


def frame_table(frame: Any) -> list[str]:
    """A pandas frame as a text table: every column, integers and floats written by `number`'s rule."""
    import pandas as pd

    def column(name: str) -> Column:
        dtype = frame[name].dtype
        if pd.api.types.is_bool_dtype(dtype):
            return Column(name)
        if pd.api.types.is_integer_dtype(dtype):
            return Column(name, INTEGER)
        return Column(name, FLOAT if pd.api.types.is_float_dtype(dtype) else "{}")

    return text_table([column(str(name)) for name in frame.columns], frame.to_dict("records"))


def note_lines(notes: Iterable[str], indent: str = "") -> list[str]:
    return [f"{indent}note: {note}" for note in notes]
