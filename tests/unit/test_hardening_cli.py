"""The `moeviz` command under a hostile environment, the refusals that come before any model is
loaded: a read-only or wrong --out, a device this build lacks, inputs that are not regular files; and the
Parquet writer's stale `.partial` files and fsync. Each refusal is one line naming the problem (exit 2),
never a traceback. Failures while a captured trace is written, Ctrl-C, transformers' load errors:
tests/models/test_hardening_cli_writes.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from moeviz.cli.flags import TEXT_FILE_LIMIT
from moeviz.models.loading import DEFAULT_SAMPLE as MODEL
from moeviz.testing.scale_traces import synthetic_trace
from moeviz.trace import Trace
from tests.support.cli import no_load, run_cli


def _capture(capsys, out: Path, *flags: str):
    return run_cli(capsys, "capture", "--model", MODEL, "--text", "hello there", "--out", str(out), *flags)


# ---- environment errors ----------------------------------------------------------------------------------
@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a 0o500 folder: chmod cannot test this")
def test_capture_into_a_read_only_folder(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        no_load(monkeypatch)
        result = _capture(capsys, folder / "t.parquet")
        assert result.code == 2
        result.one_line("not writable")
    finally:
        folder.chmod(0o700)


@pytest.mark.parametrize("name", ["existing.parquet", "plain-folder"])
def test_out_naming_a_folder_is_refused_before_the_forward(tmp_path, monkeypatch, capsys, name):
    out = tmp_path / name
    out.mkdir()
    no_load(monkeypatch)
    result = _capture(capsys, out)
    assert result.code == 2
    result.one_line(str(out), "is a folder")


@pytest.mark.parametrize("device_map", ["cuda:7", "7", '{"": "cuda:7"}', '{"model": 7}'])
def test_device_map_on_a_gpu_this_build_lacks(tmp_path, monkeypatch, capsys, device_map):
    if torch.cuda.is_available() and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    no_load(monkeypatch)
    out = tmp_path / "t.parquet"
    result = _capture(capsys, out, "--device-map", device_map)
    assert result.code == 2
    result.one_line("--device-map", "CUDA")
    assert not out.exists()


# ---- stale .partial files ---------------------------------------------------------------------------------
def _small_trace() -> Trace:
    return synthetic_trace(num_experts=8, k=2, n_group=1, topk_group=1, num_blocks=2, first_dense=0,
                           num_tokens=16)  # fmt: skip


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_stale_partial_files_are_removed_by_the_next_write(tmp_path):
    out = tmp_path / "t.parquet"
    stale = [tmp_path / ".t.parquet.partial", tmp_path / f".t.parquet.{_dead_pid()}.partial"]
    for path in stale:
        path.write_bytes(b"PAR1 half a file")
    live = tmp_path / f".t.parquet.{os.getppid()}.partial"  # a writer still running: left alone
    live.write_bytes(b"PAR1 being written")
    other = tmp_path / ".other.parquet.partial"  # another target's: not this write's business
    other.write_bytes(b"x")
    trace = _small_trace()
    trace.to_parquet(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([out.name, live.name, other.name])
    back = Trace.from_parquet(out)
    pd.testing.assert_frame_equal(back.routing_frame(), trace.routing_frame())


def test_parquet_is_fsynced_before_the_rename(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, Path.replace

    def fsync(fd):
        events.append(("fsync", os.fstat(fd).st_size))
        real_fsync(fd)

    def replace(self, target):
        events.append(("replace", self.stat().st_size))
        return real_replace(self, target)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(Path, "replace", replace)
    out = _small_trace().to_parquet(tmp_path / "t.parquet")
    kinds = [kind for kind, _ in events]
    assert "fsync" in kinds and kinds.index("fsync") < kinds.index("replace")
    size = out.stat().st_size
    assert events[kinds.index("fsync")][1] == size == events[kinds.index("replace")][1]


# ---- messages that name the actual problem ---------------------------------------------------------------
def _fifo(tmp_path: Path) -> Path:
    path = tmp_path / "pipe.txt"
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("command", ["capture", "report"])
@pytest.mark.parametrize(
    ("make", "problem"),
    [
        (lambda tmp: tmp, "is a folder"),
        (_fifo, "is not a regular file"),
        (lambda tmp: Path("/dev/zero"), "MiB limit"),
        (lambda tmp: tmp / "missing.txt", "does not exist"),
    ],
    ids=["folder", "fifo", "dev-zero", "missing"],
)
def test_text_file_names_the_problem(tmp_path, monkeypatch, capsys, command, make, problem):
    path = make(tmp_path)
    if not path.exists() and "missing" not in path.name:
        pytest.skip(f"no {path} here")
    no_load(monkeypatch)
    argv = [command, "--model", MODEL, "--text-file", str(path)]
    if command == "capture":
        argv += ["--out", str(tmp_path / "t.parquet")]
    result = run_cli(capsys, *argv)
    assert result.code == 2
    result.one_line(f"--text-file {path}", problem)


def test_text_file_over_the_size_limit(tmp_path, monkeypatch, capsys):
    big = tmp_path / "big.txt"
    with open(big, "wb") as handle:  # sparse: no disk used
        handle.truncate(TEXT_FILE_LIMIT + 1)
    no_load(monkeypatch)
    result = run_cli(
        capsys, "capture", "--model", MODEL, "--text-file", str(big), "--out", str(tmp_path / "t.parquet")
    )
    assert result.code == 2
    result.one_line("MiB limit")


@pytest.mark.parametrize(
    ("make", "problem"),
    [
        (lambda tmp: (tmp / "notes.txt", "hello"), "is a file"),
        (lambda tmp: (tmp / "c.csv", "a,b"), "is a file"),
        (lambda tmp: (_fifo(tmp), None), "is not a regular file"),
    ],
    ids=["txt-file", "csv-file", "fifo"],
)
def test_report_corpus_names_the_problem(tmp_path, monkeypatch, capsys, make, problem):
    path, text = make(tmp_path)
    if text is not None:
        path.write_text(text)
    no_load(monkeypatch)
    result = run_cli(capsys, "report", "--model", MODEL, "--corpus", str(path))
    assert result.code == 2
    message = result.one_line(str(path), problem)
    assert "does not exist" not in message
    if problem == "is a file":
        assert "folder of .txt files" in message and ".jsonl" in message  # and what is expected
