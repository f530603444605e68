"""Reading a domain-labelled corpus: a folder of .txt files or a JSONL file (the one reader of report and
trace)."""

from __future__ import annotations

import pytest

from moeviz.corpus import chunk_token_ids, iter_documents, read_corpus
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


def test_jsonl_corpus(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(
        '{"text": "def f(): pass", "domain": "python"}\n\n'
        '{"text": "   "}\n'
        '{"text": "Hello there.", "extra": 1}\n'
    )
    docs = read_corpus(corpus)
    assert [(d.doc, d.domain, d.text, d.path) for d in docs] == [
        (0, "python", "def f(): pass", corpus),
        (1, "", "Hello there.", corpus),
    ]
    assert list(iter_documents(corpus)) == docs  # the same reader, lazily


def test_folder_documents_are_numbered_in_reading_order(tmp_path):
    for name in ("b.txt", "a.txt"):
        (tmp_path / name).write_text(name)
    assert [(d.doc, d.domain, d.text) for d in read_corpus(tmp_path)] == [
        (0, "a", "a.txt"),
        (1, "b", "b.txt"),
    ]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"text": "ok"}\n{"no_text": 1}\n', "line 2 has no string field 'text'"),
        (b'{"text": "ok"}\nnot json\n', "line 2 is not valid JSON"),
        (b'{"text": "ok", "domain": 3}\n', "'domain' must be a string"),
        (b'{"text": "ok"}\n{"text": "\xff\xfe"}\n', "not UTF-8"),
        (b'{"text": "  "}\n', "holds no non-empty text"),
    ],
)
def test_bad_jsonl_corpus(tmp_path, content, message):
    corpus = tmp_path / "c.jsonl"
    corpus.write_bytes(content)
    with pytest.raises(InputError, match=message):
        read_corpus(corpus)


def test_corpus_file_must_be_jsonl(tmp_path):
    (tmp_path / "c.csv").write_text("text\nhello\n")
    with pytest.raises(InputError, match=r"a folder of \.txt files or a \.jsonl file"):
        read_corpus(tmp_path / "c.csv")
