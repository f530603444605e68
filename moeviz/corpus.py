"""Read a corpus of texts labelled by domain, for reports and specialisation analysis.

Layout: one sub-folder per domain holding `.txt` files (`corpus/python/a.txt` → domain "python"), or
files directly in the folder named after their domain, optionally numbered (`corpus/python.txt`,
`corpus/python_1.txt`, `corpus/python-2.txt` → "python"; `corpus/bible_es.txt` → "bible_es").
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from moeviz.errors import InputError


@dataclass(frozen=True)
class Document:
    domain: str
    path: Path
    text: str


def corpus_files(folder: Path) -> list[tuple[str, Path]]:
    """(domain, path) of every `.txt` file under `folder` (the layout rule above), sorted by domain, then
    path."""
    files = []
    for path in folder.rglob("*.txt"):
        relative = path.relative_to(folder)
        domain = relative.parts[0] if len(relative.parts) > 1 else re.sub(r"[_-]\d+$", "", path.stem)
        files.append((domain, path))
    return sorted(files, key=lambda item: (item[0], str(item[1])))


def read_corpus(folder: str | Path) -> list[Document]:
    """All non-empty `.txt` documents under `folder`, in a stable order (domain, then file name)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise InputError(f"corpus folder {folder} does not exist")
    docs = []
    for domain, path in corpus_files(folder):
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise InputError(f"corpus file {path} is not UTF-8 text: {exc}") from exc
        if text.strip():
            docs.append(Document(domain, path, text))
    if not docs:
        raise InputError(f"corpus folder {folder} holds no non-empty .txt file")
    return docs


def chunk_token_ids(ids: list[int], length: int, max_chunks: int | None = None) -> list[list[int]]:
    """Consecutive windows of `length` tokens (the last may be shorter), at most `max_chunks`."""
    chunks = [ids[i : i + length] for i in range(0, len(ids), length)]
    return chunks[:max_chunks] if max_chunks else chunks
