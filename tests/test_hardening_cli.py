"""The `moeviz` command under a hostile environment (issue 15): a full disk, a read-only or wrong --out, a
device this build lacks, Ctrl-C, a writer killed mid-write, and inputs that are not regular files. Each is
refused with one line naming the problem (exit 2; Ctrl-C 130), never a traceback."""

from __future__ import annotations

import errno
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

import moeviz
from moeviz import cli
from moeviz.cli.flags import TEXT_FILE_LIMIT
from moeviz.models.loading import DEFAULT_SAMPLE as MODEL
from moeviz.samples import eval_dir
from moeviz.testing.scale_traces import synthetic_trace
from moeviz.trace import Trace


def _messages(err: str) -> list[str]:
    """The `moeviz:` lines of stderr (a progress bar redraws with \\r: only a line's last redraw counts)."""
    lines = (line.split("\r")[-1].strip() for line in err.splitlines())
    return [line for line in lines if line.startswith("moeviz:")]


def _one_line(capsys, *needles: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    messages = _messages(err)
    assert len(messages) == 1, err
    for needle in needles:
        assert needle in messages[0], messages[0]
    return messages[0]


def _main(argv: list[str]) -> int:
    try:
        return cli.main(argv)
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped moeviz.cli.main")


def _capture(out: Path, *flags: str) -> int:
    return _main(["capture", "--model", MODEL, "--text", "hello there", "--out", str(out), *flags])


def _no_load(monkeypatch) -> None:
    """Fail the test if the model is loaded (the refusal must come before any load or forward)."""

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(moeviz, "load_model", load)


def _raise_oserror(code: int, named: bool = True):
    def write(*args, **kwargs):
        raise OSError(code, os.strerror(code), str(args[1]) if named else None)

    return write


# ---- item 7: environment errors --------------------------------------------------------------------------
def test_capture_disk_full_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    import pyarrow.parquet as pq

    monkeypatch.setattr(pq, "write_table", _raise_oserror(errno.ENOSPC))
    out = tmp_path / "t.parquet"
    assert _capture(out) == 2
    _one_line(capsys, "no space left on device", str(out))
    assert list(tmp_path.iterdir()) == []  # neither the file nor its hidden .partial


def test_capture_to_dev_full_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    """A real ENOSPC: the Parquet bytes go to /dev/full (where the platform has it)."""
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    import pyarrow.parquet as pq

    write_table = pq.write_table
    monkeypatch.setattr(pq, "write_table", lambda table, where, **kw: write_table(table, "/dev/full", **kw))
    assert _capture(tmp_path / "t.parquet") == 2
    _one_line(capsys, "no space left on device")
    assert list(tmp_path.iterdir()) == []


def test_trace_disk_full_says_resume(tmp_path, monkeypatch, capsys):
    from moeviz.store import writer

    monkeypatch.setattr(writer, "write_part", _raise_oserror(errno.ENOSPC, named=False))
    argv = ["trace", "--model", MODEL, "--corpus", str(eval_dir()), "--out", str(tmp_path / "store"),
            "--max-batches", "1", "--batch-size", "2", "--chunk-tokens", "32", "--quiet"]  # fmt: skip
    assert _main(argv) == 2
    _one_line(capsys, "no space left on device; continue with --resume")


@pytest.mark.parametrize(("code", "words"), [(errno.EACCES, "permission denied"), (errno.EROFS, "read-only")])
def test_capture_unwritable_out_is_one_line_exit_2(tmp_path, monkeypatch, capsys, code, words):
    """A read-only --out folder, simulated: chmod does not stop root (CI runs the tests as root)."""
    import pyarrow.parquet as pq

    monkeypatch.setattr(pq, "write_table", _raise_oserror(code))
    assert _capture(tmp_path / "t.parquet") == 2
    assert words in _one_line(capsys, "cannot write").lower()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a 0o500 folder: chmod cannot test this")
def test_capture_into_a_read_only_folder(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        _no_load(monkeypatch)
        assert _capture(folder / "t.parquet") == 2
        _one_line(capsys, "not writable")
    finally:
        folder.chmod(0o700)


@pytest.mark.parametrize("name", ["existing.parquet", "plain-folder"])
def test_out_naming_a_folder_is_refused_before_the_forward(tmp_path, monkeypatch, capsys, name):
    out = tmp_path / name
    out.mkdir()
    _no_load(monkeypatch)
    assert _capture(out) == 2
    _one_line(capsys, str(out), "is a folder")


@pytest.mark.parametrize("device_map", ["cuda:7", "7", '{"": "cuda:7"}', '{"model": 7}'])
def test_device_map_on_a_gpu_this_build_lacks(tmp_path, monkeypatch, capsys, device_map):
    if torch.cuda.is_available() and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    _no_load(monkeypatch)
    out = tmp_path / "t.parquet"
    assert _capture(out, "--device-map", device_map) == 2
    _one_line(capsys, "--device-map", "CUDA")
    assert not out.exists()


# ---- item 9: interrupted capture, stale .partial files ---------------------------------------------------
@pytest.mark.parametrize("command", ["capture", "report"])
def test_ctrl_c_is_one_line_exit_130(tmp_path, monkeypatch, capsys, command):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(moeviz, "capture", interrupted)
    monkeypatch.setattr(importlib.import_module("moeviz.capture.forward"), "capture", interrupted)
    out = tmp_path / "t.parquet"
    argv = [command, "--model", MODEL, "--text", "hello there"]
    assert _main([*argv, "--out", str(out)] if command == "capture" else argv) == 130
    _one_line(capsys, "interrupted")
    assert list(tmp_path.iterdir()) == []


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


# ---- item 11: messages that name the actual problem ------------------------------------------------------
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
    _no_load(monkeypatch)
    argv = [command, "--model", MODEL, "--text-file", str(path)]
    if command == "capture":
        argv += ["--out", str(tmp_path / "t.parquet")]
    assert _main(argv) == 2
    _one_line(capsys, f"--text-file {path}", problem)


def test_text_file_over_the_size_limit(tmp_path, monkeypatch, capsys):
    big = tmp_path / "big.txt"
    with open(big, "wb") as handle:  # sparse: no disk used
        handle.truncate(TEXT_FILE_LIMIT + 1)
    _no_load(monkeypatch)
    assert (
        _main(["capture", "--model", MODEL, "--text-file", str(big), "--out", str(tmp_path / "t.parquet")])
        == 2
    )
    _one_line(capsys, "MiB limit")


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
    _no_load(monkeypatch)
    assert _main(["report", "--model", MODEL, "--corpus", str(path)]) == 2
    message = _one_line(capsys, str(path), problem)
    assert "does not exist" not in message
    if problem == "is a file":
        assert "folder of .txt files" in message and ".jsonl" in message  # and what is expected


def test_transformers_advice_is_replaced_in_the_one_line_refusal(tmp_path):
    """Weights whose shapes differ from config.json: transformers raises "... For details look at the above
    report!"; the refusal names the problem instead, on one line."""
    from moeviz.testing.tiny_models import save_tiny_model

    folder = save_tiny_model("mixtral", tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 48
    (folder / "config.json").write_text(json.dumps(config))
    out = tmp_path / "t.parquet"
    # a real process: transformers' logging handler holds the stderr of whichever test first logged
    result = subprocess.run(
        [sys.executable, "-m", "moeviz.cli", "capture", "--model", str(folder), "--token-ids", "3,4",
         "--out", str(out)],
        capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    (message,) = _messages(result.stderr)
    assert str(folder) in message and "config.json" in message, message
    assert "above report" not in message and "ignore_mismatched_sizes" not in message
    assert not out.exists()
