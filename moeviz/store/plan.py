"""A corpus streamed into a fixed, reproducible plan of batches (what makes resume and checkpoints exact).

Corpus: a folder of `.txt` files or a JSONL file, read by `moeviz.corpus` (the one corpus reader; see its
docstring). Documents are read one at a time; each is tokenized, cut into windows of `chunk_tokens` tokens
(the last may be shorter), and the windows are grouped into batches of `batch_size` sequences in reading
order. The same corpus, tokenizer and settings always give the same batches, each identified by a hash of
its token ids.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from moeviz.corpus import check_corpus, chunk_token_ids, corpus_files, iter_documents
from moeviz.errors import InputError


@dataclass(frozen=True)
class Batch:
    """token_ids [B][≤ chunk_tokens]; docs [B] and domains [B] of each sequence; seq_offset = run-wide
    index of its first sequence."""

    index: int
    seq_offset: int
    token_ids: list[list[int]]
    docs: list[int]
    domains: list[str]

    @cached_property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.token_ids)

    @cached_property
    def token_hash(self) -> str:
        return token_hash(self.token_ids)


def token_hash(token_ids: list[list[int]]) -> str:
    h = hashlib.blake2b(digest_size=12)
    for seq in token_ids:
        h.update(np.asarray(seq, dtype=np.int64).tobytes())
        h.update(b"|")
    return h.hexdigest()


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
