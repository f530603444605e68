"""Non-finite router scores through the real CLI: `python -m moeviz.cli capture` prints
one warning on stderr, naming the layer, and nothing of it on stdout."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.nan_router import save_nan_router_model

CLI_INPUT = ("--token-ids", "5,6,7", "--out")


@pytest.fixture(scope="module")
def nan_folder(tmp_path_factory):
    return save_nan_router_model(tmp_path_factory.mktemp("nan_router"))


def test_cli_capture_prints_the_warning(nan_folder, tmp_path) -> None:
    out = tmp_path / "t.parquet"
    result = subprocess.run(
        [sys.executable, "-m", "moeviz.cli", "capture", "--model", str(nan_folder), *CLI_INPUT, str(out)],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("moeviz: warning:")]
    assert len(lines) == 1 and "not finite" in lines[0] and "layer 1" in lines[0], result.stderr
    assert "not finite" not in result.stdout
