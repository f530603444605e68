"""A FIFO in place of a model's weights is refused without blocking: `moeviz capture` in a real
subprocess, killed if it hangs, exits 2 with one line. The other damaged folders:
tests/models/test_hardening_models.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_fifo_weights_are_refused_without_blocking(tiny_model_dir, tmp_path):
    """A FIFO named model.safetensors would block the first open() forever: the CLI refuses it (exit 2,
    one line) in a subprocess that is killed if it hangs."""
    folder = shutil.copytree(tiny_model_dir("mixtral"), tmp_path / "m")
    (folder / "model.safetensors").unlink()
    os.mkfifo(folder / "model.safetensors")
    args = ["capture", "--model", str(folder), "--token-ids", "3,4", "--out", str(tmp_path / "t.parquet")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "moeviz.cli", *args], capture_output=True, text=True, timeout=120, env=env
        )
    except subprocess.TimeoutExpired:
        pytest.fail("loading a folder whose weights are a FIFO blocked")
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.replace("\r", "\n").splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith("moeviz capture")]
    assert len(lines) == 1 and "not a regular file" in lines[0], done.stderr
