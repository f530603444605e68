"""Reading a domain-labelled corpus folder."""

from __future__ import annotations

import pytest

from moeviz.corpus import chunk_token_ids, read_corpus
from moeviz.errors import InputError


def test_sub_folders_are_domains(tmp_path):
    files = [
        ("python", "a.txt", "def f(): pass"),
        ("english", "b.txt", "Hello there."),
        ("python", "c.txt", "import os"),
        ("english", "empty.txt", "  \n"),
    ]
    for domain, name, text in files:
        (tmp_path / domain).mkdir(exist_ok=True)
        (tmp_path / domain / name).write_text(text)
    docs = read_corpus(tmp_path)
    assert [(d.domain, d.path.name) for d in docs] == [
        ("english", "b.txt"),
        ("python", "a.txt"),
        ("python", "c.txt"),
    ]


def test_file_names_are_domains(tmp_path):
    (tmp_path / "python_1.txt").write_text("x = 1")
    (tmp_path / "python-2.txt").write_text("y = 2")
    (tmp_path / "bible_es.txt").write_text("hola")
    assert [d.domain for d in read_corpus(tmp_path)] == ["bible_es", "python", "python"]


def test_bad_corpus(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        read_corpus(tmp_path / "missing")
    (tmp_path / "blank.txt").write_text("   ")
    with pytest.raises(InputError, match="no non-empty"):
        read_corpus(tmp_path)
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(InputError, match="not UTF-8"):
        read_corpus(tmp_path)


def test_chunking():
    assert chunk_token_ids(list(range(7)), 3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert chunk_token_ids(list(range(7)), 3, max_chunks=2) == [[0, 1, 2], [3, 4, 5]]
