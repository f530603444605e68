"""A store run's run.json is hashed and validated: a changed digit, a wrong type, a missing key or a file that
is not a regular file is refused with one line before any number in it is used."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from moeviz.errors import RunFileError, StoreError
from moeviz.store import StoreQuery, list_runs
from moeviz.store.run_file import read_run_file, run_file_bytes, run_hash
from moeviz.store.writer import write_trace
from moeviz.testing.scale_traces import synthetic_trace


@pytest.fixture
def run_json(tmp_path) -> Path:
    trace = synthetic_trace(
        num_experts=8, k=2, n_group=1, topk_group=1, num_blocks=3, first_dense=1, num_tokens=8
    )
    run = write_trace(trace, tmp_path / "store", model="m")
    return run.path / "run.json"


def test_the_run_file_records_the_hash_of_its_content(run_json):
    config = json.loads(run_json.read_bytes())
    content = json.dumps({k: v for k, v in config.items() if k != "sha256"}, sort_keys=True).encode()
    assert config["sha256"] == hashlib.sha256(content).hexdigest()  # the definition, computed apart
    assert read_run_file(run_json) == config


def test_a_changed_digit_is_refused_where_it_was_a_ninth_dead_expert(run_json):
    text = run_json.read_text()
    run_json.write_text(text.replace('"num_experts": 8', '"num_experts": 9', 1))
    with pytest.raises(RunFileError, match="does not match its sha256"):
        list_runs(run_json.parents[2])
    with pytest.raises(StoreError, match="does not match its sha256"):
        StoreQuery(run_json.parents[2])


def _rewrite(run_json: Path, edit) -> None:
    """Change the content and record its hash again: only the schema is hostile."""
    config = json.loads(run_json.read_bytes())
    edited = edit(config)
    run_json.write_bytes(run_file_bytes(edited) if isinstance(edited, dict) else json.dumps(edited).encode())


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: [c], "a JSON list, not an object"),
        (lambda c: c["layers"][0].pop("site") and c, r"layers\[0\]: expected the keys"),
        (lambda c: {**c, "batch_size": "2"}, "batch_size: expected int, got '2'"),
        (lambda c: {**c, "checkpoint_index": -1}, "checkpoint_index: -1 is below 0"),
        (lambda c: {**c, "confidence": 1}, "confidence: expected bool"),
        (lambda c: {**c, "evil": 1}, r"keys: unknown \['evil'\]"),
        (lambda c: {k: v for k, v in c.items() if k != "source"}, r"keys: missing \['source'\]"),
        (lambda c: c["layers"][0].update(k=9) or c, "k = 9 of 8 experts is not a router"),
        (lambda c: c["layers"][0].update(bias=[0.0]) or c, "bias: expected null or 8 numbers"),
        (lambda c: c["layers"][0].update(num_experts=True) or c, r"num_experts: expected int, got True"),
    ],
)
def test_a_run_file_of_another_schema_is_refused(run_json, edit, message):
    _rewrite(run_json, edit)
    with pytest.raises(RunFileError, match=message):
        read_run_file(run_json)


def test_deep_or_broken_json_is_refused(run_json):
    run_json.write_bytes(b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(RunFileError, match="not valid JSON"):
        read_run_file(run_json)
    run_json.write_bytes(b'{"source": ')
    with pytest.raises(RunFileError, match="not valid JSON"):
        read_run_file(run_json)


def test_a_fifo_is_refused_without_blocking(run_json):
    run_json.unlink()
    os.mkfifo(run_json)
    with pytest.raises(RunFileError, match="not a regular file"):
        list_runs(run_json.parents[2])


def test_a_run_file_written_before_hashes_reads_unverified(run_json):
    config = json.loads(run_json.read_bytes())
    del config["sha256"]
    run_json.write_text(json.dumps(config))
    assert read_run_file(run_json) == config
    assert run_hash(config) == run_hash({**config, "sha256": "anything"})  # the hash leaves itself out


def test_a_store_another_writer_is_creating_is_not_called_foreign(tmp_path):
    """Two fresh `moeviz trace` runs into one new folder: the second finds the folder holding only the first's
    marker temp file, and joins the store instead of refusing it as "not a moeviz store"."""
    from moeviz.store.layout import STORE_FILE, init_store

    root = tmp_path / "store"
    root.mkdir()
    (root / f".{STORE_FILE}.{os.getpid() + 1}.tmp").write_text("{")  # the other writer, mid-write
    assert init_store(root) == root and (root / STORE_FILE).is_file()
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    with pytest.raises(StoreError, match="a non-empty folder that is not a moeviz store"):
        init_store(tmp_path / "foreign")
