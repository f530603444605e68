"""Traces kept on disk between processes (`moeviz.trace.kept`): the key changes with everything the capture
depends on and with nothing else, a kept trace reads back bit for bit, and a damaged file, a folder that
cannot be written or keeping turned off read as nothing kept, never as an error or a half-written file."""

from __future__ import annotations

import os

import numpy as np
import pytest

from moeviz.settings import current_settings
from moeviz.trace import kept
from tests.support.traces import assert_traces_equal, make_trace, random_layer


@pytest.fixture
def model_folder(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "mixtral"}')
    (folder / "model.safetensors").write_bytes(b"\0" * 64)
    return folder


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("MOEVIZ_CACHE_DIR", str(folder))
    return folder


def _trace(seed: int = 0):
    rng = np.random.default_rng(seed)
    return make_trace([random_layer(rng, 12, 8, 2) for _ in range(3)])


def test_the_key_follows_the_files_the_text_and_the_options(model_folder):
    key = kept.trace_key(model_folder, "text")
    assert kept.trace_key(model_folder, "text") == key  # nothing changed: the same key
    assert kept.trace_key(model_folder, "text ") != key
    assert kept.trace_key(model_folder, "text", options="dtype=bfloat16") != key
    (model_folder / ".cache").mkdir()
    (model_folder / ".cache" / "lock").write_text("x")  # hidden: a hub lock, a partial write
    assert kept.trace_key(model_folder, "text") == key
    weights = model_folder / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # rewritten, same size
    touched = kept.trace_key(model_folder, "text")
    assert touched != key
    (model_folder / "sub").mkdir()
    (model_folder / "sub" / "extra.bin").write_bytes(b"1")
    assert kept.trace_key(model_folder, "text") not in (key, touched)


def test_the_key_follows_the_installed_versions(model_folder, monkeypatch):
    key = kept.trace_key(model_folder, "text")
    versions = dict(kept._versions())
    monkeypatch.setattr(kept, "_versions", lambda: {**versions, "torch": "0.0.1"})
    assert kept.trace_key(model_folder, "text") != key


def test_a_kept_trace_reads_back_bitwise(cache):
    trace = _trace()
    path = kept.keep_trace("abc", trace)
    assert path == cache / "traces" / "abc.parquet"
    assert_traces_equal(kept.kept_trace("abc"), trace)
    assert kept.kept_trace("other") is None
    assert [p.name for p in path.parent.iterdir()] == ["abc.parquet"]  # no partial file left


def test_a_damaged_file_reads_as_nothing_and_is_removed(cache):
    path = kept.keep_trace("abc", _trace())
    path.write_bytes(path.read_bytes()[:-100])
    assert kept.kept_trace("abc") is None
    assert not path.exists()


def test_keeping_turned_off_or_impossible_keeps_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEVIZ_CACHE_DIR", "")
    assert current_settings().cache_dir is None
    assert kept.keep_trace("abc", _trace()) is None
    assert kept.kept_trace("abc") is None
    blocker = tmp_path / "file"
    blocker.write_text("a file where the folder would be")
    monkeypatch.setenv("MOEVIZ_CACHE_DIR", str(blocker))
    assert kept.keep_trace("abc", _trace()) is None
    assert blocker.read_text() == "a file where the folder would be"


def test_only_the_newest_files_are_kept(cache, monkeypatch):
    monkeypatch.setattr(kept, "KEPT_TRACES", 2)
    for i, key in enumerate("abc"):
        path = kept.keep_trace(key, _trace(i))
        os.utime(path, ns=(i * 10**9, i * 10**9))  # written in this order, a second apart
    assert sorted(p.stem for p in (cache / "traces").iterdir()) == ["b", "c"]


def test_the_default_folder_is_the_users_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("MOEVIZ_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert current_settings().cache_dir == tmp_path / "moeviz"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert current_settings().cache_dir == tmp_path / "home" / ".cache" / "moeviz"
