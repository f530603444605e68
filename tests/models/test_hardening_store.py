"""Store hardening: content hashes catch bit flips, the manifest is not trusted beyond the run
folder, and one writer per run (a lock; only dead writers' temp files are removed)."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

from moeviz.cli import main
from moeviz.store import StoreError, StoreQuery, TraceSettings, validate_store, write_corpus
from moeviz.store.layout import MANIFEST_FILE, run_lock

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
SETTINGS = TraceSettings(batch_size=4, chunk_tokens=96, max_batches=3)
CLI_ARGS = ["--batch-size", "4", "--chunk-tokens", "96", "--max-batches", "3", "--quiet"]


@pytest.fixture(scope="module")
def built(sample_model, corpus, tmp_path_factory):
    store = tmp_path_factory.mktemp("hardening") / "store"
    write_corpus(sample_model, corpus, store, settings=SETTINGS, progress=False)
    return store


def _copy(store, tmp_path):
    target = tmp_path / "store"
    shutil.copytree(store, target, symlinks=True)
    run = next(target.glob("model=*/checkpoint=*"))
    return target, run


def _rows(store):
    return StoreQuery(store).sql("SELECT * FROM rows ORDER BY batch, seq, pos, layer, rank")


def _entries(run):
    return [json.loads(line) for line in (run / MANIFEST_FILE).read_text().splitlines() if line.strip()]


def _write_entries(run, entries):
    (run / MANIFEST_FILE).write_text("".join(json.dumps(e) + "\n" for e in entries))


# ---- content hashes ------------------------------------------------------------------------------------
def test_every_bit_flip_is_detected_and_resume_retraces_the_part(built, sample_model, corpus, tmp_path):
    store, run = _copy(built, tmp_path)
    part = run / "part-000001.parquet"
    original = part.read_bytes()
    want = _rows(built)
    rng = np.random.default_rng(15)
    for bit in rng.choice(len(original) * 8, size=20, replace=False):
        data = bytearray(original)
        data[bit // 8] ^= 1 << (bit % 8)
        part.write_bytes(bytes(data))
        problems = validate_store(store)
        # a flip in the footer is "not a readable Parquet file", anywhere else a hash mismatch
        assert len(problems) == 1 and part.name in problems[0], (bit, problems)
        with pytest.raises(StoreError, match=part.name):
            StoreQuery(store, validate=False)  # the app's filtered queries check the hash too
        with pytest.raises(StoreError, match=part.name):
            StoreQuery(store)
    # the last flip stays: --resume traces that batch again and the store is whole
    write_corpus(sample_model, corpus, store, settings=SETTINGS, resume=True, progress=False)
    assert validate_store(store) == []
    assert part.read_bytes() == original
    assert sorted(e["batch"] for e in _entries(run)) == [0, 1, 2]
    got = _rows(store)
    assert got.equals(want)


def test_manifest_without_hashes_still_opens_as_unverified(built, tmp_path):
    store, run = _copy(built, tmp_path)
    _write_entries(run, [{k: v for k, v in e.items() if k != "sha256"} for e in _entries(run)])
    notes: list[str] = []
    assert validate_store(store, notes=notes) == []
    assert len(notes) == 3 and all("unverified" in n for n in notes)
    assert len(StoreQuery(store, validate=False).sql("SELECT * FROM rows")) > 0


# ---- the manifest is not trusted beyond the run folder --------------------------------------------------
def _outside_copy(run, tmp_path):
    outside = tmp_path / "x.parquet"
    outside.write_bytes((run / "part-000000.parquet").read_bytes())
    return outside


@pytest.mark.parametrize("where", ["parent", "absolute", "subfolder"])
def test_entry_outside_the_run_folder_is_refused(built, tmp_path, where):
    store, run = _copy(built, tmp_path)
    outside = _outside_copy(run, tmp_path)
    shutil.copy(outside, run.parent / "x.parquet")
    (run / "sub").mkdir()
    shutil.copy(outside, run / "sub" / "x.parquet")
    name = {"parent": "../x.parquet", "absolute": str(outside), "subfolder": "sub/x.parquet"}[where]
    entries = _entries(run)
    entries[0]["file"] = name
    _write_entries(run, entries)
    for open_store in (validate_store, lambda s: StoreQuery(s, validate=False)):
        with pytest.raises(StoreError, match="not a plain part file name"):
            open_store(store)


def test_symlinked_part_is_refused(built, tmp_path):
    store, run = _copy(built, tmp_path)
    outside = _outside_copy(run, tmp_path)  # same bytes: size and hash match, only the link is wrong
    part = run / "part-000000.parquet"
    part.unlink()
    part.symlink_to(outside)
    assert any(part.name in p and "symlink" in p for p in validate_store(store))
    with pytest.raises(StoreError, match=r"part-000000\.parquet: a symlink"):
        StoreQuery(store, validate=False)


@pytest.mark.parametrize("field", ["bytes", "file", "batch", "rows", "token_hash"])
def test_incomplete_entry_is_refused(built, tmp_path, field):
    store, run = _copy(built, tmp_path)
    entries = _entries(run)
    del entries[1][field]
    _write_entries(run, entries)
    for open_store in (validate_store, lambda s: StoreQuery(s, validate=False)):
        with pytest.raises(StoreError, match=f"line 2 is incomplete: missing {field}"):
            open_store(store)


@pytest.mark.parametrize("how", ["same line twice", "same file, other batch"])
def test_duplicated_entry_is_refused(built, tmp_path, how):
    store, run = _copy(built, tmp_path)
    entries = _entries(run)
    extra = dict(entries[0]) if how == "same line twice" else {**entries[0], "batch": 7}
    _write_entries(run, [*entries, extra])
    for open_store in (validate_store, lambda s: StoreQuery(s, validate=False)):
        with pytest.raises(StoreError, match=r"line 4 lists .* a second time"):
            open_store(store)


# ---- one writer per run ---------------------------------------------------------------------------------
def _dead_pid() -> int:
    """A pid no process of this host has (from the top of the pid range down)."""
    top = (
        int(Path("/proc/sys/kernel/pid_max").read_text())
        if Path("/proc/sys/kernel/pid_max").is_file()
        else 32768
    )
    for pid in range(top - 1, 1, -1):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            continue
    raise AssertionError("no free pid")


def test_second_writer_is_refused_and_live_temp_files_survive(sample_model, corpus, tmp_path):
    store = tmp_path / "store"
    refused: list[BaseException] = []
    live: list = []

    def second_writer(batch) -> None:
        if batch.index:
            return
        run = next(store.glob("model=*/checkpoint=*"))
        temp = run / f".part-000009.parquet.{os.getpid()}.tmp"  # a live writer's temp file
        temp.write_bytes(b"half a part")
        live.append(temp)

        def attempt() -> None:
            try:
                write_corpus(sample_model, corpus, store, settings=SETTINGS, resume=True, progress=False)
            except StoreError as exc:
                refused.append(exc)

        thread = threading.Thread(target=attempt)
        thread.start()
        thread.join()

    write_corpus(sample_model, corpus, store, settings=SETTINGS, progress=False, on_batch=second_writer)
    assert len(refused) == 1 and f"pid {os.getpid()}" in str(refused[0])
    assert live[0].exists()  # the refused writer removed nothing
    assert validate_store(store) == []
    # after the first writer ends, a new one proceeds; a dead writer's temp file is removed
    dead = live[0].with_name(f".part-000010.parquet.{_dead_pid()}.tmp")
    dead.write_bytes(b"left by a kill")
    run = write_corpus(sample_model, corpus, store, settings=SETTINGS, resume=True, progress=False)
    assert run.complete and not dead.exists() and live[0].exists()


def test_cli_refuses_a_second_writer_with_exit_2(sample_model, corpus, tmp_path, capsys):
    store = tmp_path / "store"
    args = ["trace", "--model", "sample:mixtral-healthy", "--corpus", str(corpus), "--out", str(store)]
    assert main([*args, *CLI_ARGS]) == 0
    run = next(store.glob("model=*/checkpoint=*"))
    capsys.readouterr()
    with run_lock(run):
        assert main([*args, *CLI_ARGS, "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"pid {os.getpid()}" in err and "one writer per run" in err
    assert main([*args, *CLI_ARGS, "--resume"]) == 0
