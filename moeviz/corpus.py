"""Read a corpus of texts labelled by domain: the one reader behind `moeviz report --corpus`, `moeviz trace
--corpus` and the corpus store.

A corpus is either
- a folder of `.txt` files: one sub-folder per domain (`corpus/python/a.txt` → domain "python"), or files
  directly in the folder named after their domain, optionally numbered (`corpus/python.txt`,
  `corpus/python_1.txt`, `corpus/python-2.txt` → "python"; `corpus/bible_es.txt` → "bible_es"); or
- a JSONL file (`.jsonl`, `.ndjson` or `.json`), one object per line with a string field "text" and an
  optional string field "domain" (default "").

Documents are read one at a time in a stable order (domain, then file name; or line order); empty ones are
skipped.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from moeviz.errors import InputError

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")


@dataclass(frozen=True)
class Document:
    """One non-empty document: its index in reading order, domain, text and the file it came from (the
    JSONL file itself for a JSONL corpus)."""

    doc: int
    domain: str
    text: str
    path: Path


def corpus_files(folder: Path) -> list[tuple[str, Path]]:
    """(domain, path) of every `.txt` file under `folder` (the layout rule above), sorted by domain, then
    path."""
    files = []
    for path in folder.rglob("*.txt"):
        relative = path.relative_to(folder)
        domain = relative.parts[0] if len(relative.parts) > 1 else re.sub(r"[_-]\d+$", "", path.stem)
        files.append((domain, path))
    return sorted(files, key=lambda item: (item[0], str(item[1])))


def check_corpus(path: str | Path) -> Path:
    """Fail early (InputError) on a corpus that cannot be read, before any model is loaded."""
    path = Path(path)
    if path.is_dir():
        if not corpus_files(path):
            raise InputError(f"corpus folder {path} holds no .txt file")
    elif path.is_file():
        if path.suffix not in JSONL_SUFFIXES:
            raise InputError(
                f"corpus {path} is a file, not a JSONL file: give a folder of .txt files or a .jsonl file "
                "(or .ndjson, .json; one object per line)"
            )
    elif path.exists():
        raise InputError(f"corpus {path} is not a regular file or folder (a FIFO or a device?)")
    else:
        raise InputError(f"corpus {path} does not exist")
    return path


def iter_documents(path: str | Path) -> Iterator[Document]:
    """The documents of a corpus, read lazily (one in memory at a time), in a stable order."""
    path = check_corpus(path)
    index = 0
    if path.is_dir():
        for domain, file in corpus_files(path):
            try:
                text = file.read_text(encoding="utf-8")
            except UnicodeDecodeError as exc:
                raise InputError(f"corpus file {file} is not UTF-8 text: {exc}") from exc
            if text.strip():
                yield Document(index, domain, text, file)
                index += 1
        return
    with open(path, encoding="utf-8") as handle:
        for number, line in _lines(path, handle):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(f"{path}: line {number} is not valid JSON ({exc.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise InputError(f"{path}: line {number} has no string field 'text'")
            domain = record.get("domain", "")
            if not isinstance(domain, str):
                raise InputError(f"{path}: line {number}: 'domain' must be a string")
            if record["text"].strip():
                yield Document(index, domain, record["text"], path)
                index += 1


def _lines(path: Path, handle) -> Iterator[tuple[int, str]]:
    """(line number, line) of a text file; InputError on bytes that are not UTF-8."""
    number = 0
    try:
        for number, line in enumerate(handle, 1):
            yield number, line
    except UnicodeDecodeError as exc:
        raise InputError(f"corpus {path}: line {number + 1} is not UTF-8 text: {exc}") from exc


def read_corpus(path: str | Path) -> list[Document]:
    """Every non-empty document of a corpus folder or JSONL file (see the module docstring), in order."""
    docs = list(iter_documents(path))
    if not docs:
        what = "non-empty .txt file" if Path(path).is_dir() else "non-empty text"
        raise InputError(f"corpus {path} holds no {what}")
    return docs


def chunk_token_ids(ids: list[int], length: int, max_chunks: int | None = None) -> list[list[int]]:
    """Consecutive windows of `length` tokens (the last may be shorter), at most `max_chunks`."""
    chunks = [ids[i : i + length] for i in range(0, len(ids), length)]
    return chunks[:max_chunks] if max_chunks else chunks
