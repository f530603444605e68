"""The `moeviz` command under a hostile environment, once a model is loaded: a full disk or an
unwritable --out while the captured trace is written, Ctrl-C during the forward, and a checkpoint whose
weights do not fit its config. Each is refused with one line naming the problem (exit 2; Ctrl-C 130), never
a traceback, and nothing is left behind. The refusals before any load: tests/unit/test_hardening_cli.py;
a real Ctrl-C: tests/system/test_cli_process.py."""

from __future__ import annotations

import errno
import importlib
import json
import os
from pathlib import Path

import pytest

import moeviz
from moeviz.models.loading import DEFAULT_SAMPLE as MODEL
from moeviz.samples import eval_dir
from tests.support.cli import run_cli


def _capture(capsys, out: Path, *flags: str):
    return run_cli(capsys, "capture", "--model", MODEL, "--text", "hello there", "--out", str(out), *flags)


def _raise_oserror(code: int, named: bool = True):
    def write(*args, **kwargs):
        raise OSError(code, os.strerror(code), str(args[1]) if named else None)

    return write


# ---- environment errors ----------------------------------------------------------------------------------
def test_capture_disk_full_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    import pyarrow.parquet as pq

    monkeypatch.setattr(pq, "write_table", _raise_oserror(errno.ENOSPC))
    out = tmp_path / "t.parquet"
    result = _capture(capsys, out)
    assert result.code == 2
    result.one_line("no space left on device", str(out))
    assert list(tmp_path.iterdir()) == []  # neither the file nor its hidden .partial


def test_capture_to_dev_full_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    """A real ENOSPC: the Parquet bytes go to /dev/full (where the platform has it)."""
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    import pyarrow.parquet as pq

    write_table = pq.write_table
    monkeypatch.setattr(pq, "write_table", lambda table, where, **kw: write_table(table, "/dev/full", **kw))
    result = _capture(capsys, tmp_path / "t.parquet")
    assert result.code == 2
    result.one_line("no space left on device")
    assert list(tmp_path.iterdir()) == []


def test_trace_disk_full_says_resume(tmp_path, monkeypatch, capsys):
    from moeviz.store import writer

    monkeypatch.setattr(writer, "write_part", _raise_oserror(errno.ENOSPC, named=False))
    argv = ["trace", "--model", MODEL, "--corpus", str(eval_dir()), "--out", str(tmp_path / "store"),
            "--max-batches", "1", "--batch-size", "2", "--chunk-tokens", "32", "--quiet"]  # fmt: skip
    result = run_cli(capsys, *argv)
    assert result.code == 2
    result.one_line("no space left on device; continue with --resume")


@pytest.mark.parametrize(("code", "words"), [(errno.EACCES, "permission denied"), (errno.EROFS, "read-only")])
def test_capture_unwritable_out_is_one_line_exit_2(tmp_path, monkeypatch, capsys, code, words):
    """A read-only --out folder, simulated: chmod does not stop root (CI runs the tests as root)."""
    import pyarrow.parquet as pq

    monkeypatch.setattr(pq, "write_table", _raise_oserror(code))
    result = _capture(capsys, tmp_path / "t.parquet")
    assert result.code == 2
    assert words in result.one_line("cannot write").lower()
    assert list(tmp_path.iterdir()) == []


# ---- interrupted capture ----------------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["capture", "report"])
def test_ctrl_c_is_one_line_exit_130(tmp_path, monkeypatch, capsys, command):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(moeviz, "capture", interrupted)
    monkeypatch.setattr(importlib.import_module("moeviz.capture.forward"), "capture", interrupted)
    out = tmp_path / "t.parquet"
    argv = [command, "--model", MODEL, "--text", "hello there"]
    result = run_cli(capsys, *argv, "--out", str(out)) if command == "capture" else run_cli(capsys, *argv)
    assert result.code == 130
    result.one_line("interrupted")
    assert list(tmp_path.iterdir()) == []


# ---- messages that name the actual problem ---------------------------------------------------------------
def test_transformers_advice_is_replaced_in_the_one_line_refusal(tmp_path, capsys):
    """Weights whose shapes differ from config.json: transformers raises "... For details look at the above
    report!"; the refusal names the problem instead, on one line (transformers' own log lines, the report,
    go to the same stderr, as in a process of its own)."""
    from moeviz.testing.tiny_models import save_tiny_model

    folder = save_tiny_model("mixtral", tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 48
    (folder / "config.json").write_text(json.dumps(config))
    out = tmp_path / "t.parquet"
    result = run_cli(capsys, "capture", "--model", str(folder), "--token-ids", "3,4", "--out", str(out))
    assert result.code == 2
    message = result.one_line(str(folder), "config.json")
    assert "above report" not in message and "ignore_mismatched_sizes" not in message
    assert not out.exists()
