"""A corpus streamed into a fixed, reproducible plan of batches (what makes resume and checkpoints exact).

Corpus: a folder (one sub-folder per domain, or files named after their domain, as `moeviz.corpus`) or a
JSONL file, one object per line with a "text" field and an optional "domain" field. Documents are read one
at a time; each is tokenized, cut into windows of `chunk_tokens` tokens (the last may be shorter), and the
windows are grouped into batches of `batch_size` sequences in reading order. The same corpus, tokenizer
and settings always give the same batches, each identified by a hash of its token ids.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moeviz.corpus import chunk_token_ids, corpus_files
from moeviz.errors import InputError


@dataclass(frozen=True)
class CorpusDoc:
    doc: int  # index in reading order
    domain: str
    text: str


@dataclass(frozen=True)
class Batch:
    """token_ids [B][≤ chunk_tokens]; docs [B] and domains [B] of each sequence; seq_offset = run-wide
    index of its first sequence."""

    index: int
    seq_offset: int
    token_ids: list[list[int]]
    docs: list[int]
    domains: list[str]

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.token_ids)

    @property
    def token_hash(self) -> str:
        return token_hash(self.token_ids)


def token_hash(token_ids: list[list[int]]) -> str:
    h = hashlib.blake2b(digest_size=12)
    for seq in token_ids:
        h.update(np.asarray(seq, dtype=np.int64).tobytes())
        h.update(b"|")
    return h.hexdigest()


def check_corpus(path: str | Path) -> Path:
    """Fail early (InputError) on a corpus that cannot be read, before any model is loaded."""
    path = Path(path)
    if path.is_dir():
        if not corpus_files(path):
            raise InputError(f"corpus folder {path} holds no .txt file")
    elif path.is_file():
        if path.suffix not in (".jsonl", ".json", ".ndjson"):
            raise InputError(f"corpus {path}: give a folder of .txt files or a .jsonl file")
    else:
        raise InputError(f"corpus {path} does not exist")
    return path


def corpus_fingerprint(path: str | Path) -> dict:
    """Cheap identity of the corpus (names and sizes of its files) recorded with a run."""
    path = check_corpus(path)
    if path.is_dir():
        files = corpus_files(path)
        listing = [(d, str(p.relative_to(path)), p.stat().st_size) for d, p in files]
    else:
        listing = [("", path.name, path.stat().st_size)]
    digest = hashlib.blake2b(json.dumps(listing).encode(), digest_size=12).hexdigest()
    return {
        "path": str(path.resolve()),
        "files": len(listing),
        "bytes": sum(s for *_, s in listing),
        "id": digest,
    }


def iter_documents(path: str | Path) -> Iterator[CorpusDoc]:
    """Documents in a stable order, read lazily (one in memory at a time). Empty documents are skipped."""
    path = check_corpus(path)
    index = 0
    if path.is_dir():
        for domain, file in corpus_files(path):
            try:
                text = file.read_text(encoding="utf-8")
            except UnicodeDecodeError as exc:
                raise InputError(f"corpus file {file} is not UTF-8 text: {exc}") from exc
            if text.strip():
                yield CorpusDoc(index, domain, text)
                index += 1
        return
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
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
                yield CorpusDoc(index, domain, record["text"])
                index += 1


def iter_batches(
    path: str | Path,
    tokenize: Callable[[str], list[int]],
    chunk_tokens: int,
    batch_size: int,
    max_batches: int | None = None,
) -> Iterator[Batch]:
    """The fixed batch plan of a corpus (see the module docstring); memory: one document + one batch."""
    if chunk_tokens < 1 or batch_size < 1:
        raise InputError(f"chunk_tokens and batch_size must be >= 1, got {chunk_tokens}, {batch_size}")
    pending: list[tuple[list[int], int, str]] = []
    index = seq = 0
    for doc in iter_documents(path):
        for chunk in chunk_token_ids(list(tokenize(doc.text)), chunk_tokens):
            pending.append((chunk, doc.doc, doc.domain))
            if len(pending) == batch_size:
                if max_batches is not None and index >= max_batches:
                    return
                yield Batch(index, seq, *map(list, zip(*pending, strict=True)))
                index, seq, pending = index + 1, seq + len(pending), []
    if pending and (max_batches is None or index < max_batches):
        yield Batch(index, seq, *map(list, zip(*pending, strict=True)))
