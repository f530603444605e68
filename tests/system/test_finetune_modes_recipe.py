"""The fine-tuning run shipped for the Learn page (sample_models/finetune-modes) comes from its recipe: the
recipe, run here as a real subprocess for its first steps only (`--stop-after`, the same 60-step schedule),
gives the first rows of the shipped curves and per-layer balance of every mode, and the shipped run.json
names the recipe's own config. On the machine that wrote the files the rows are equal bit for bit; elsewhere
(another CPU's float kernels) within a relative 1e-5."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from moeviz.models.loading import sample_models_dir

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "samples" / "finetune_modes.py"
SHIPPED = sample_models_dir() / "finetune-modes"
STEPS = 3  # steps the check trains of each mode
RTOL = 1e-5

pytestmark = pytest.mark.slow


def _same(mine: pd.DataFrame, shipped: pd.DataFrame, what: str) -> None:
    """Equal columns and keys; numbers equal within RTOL (NaN where the other is NaN)."""
    assert list(mine.columns) == list(shipped.columns), what
    assert len(mine) == len(shipped) > 0, what
    for column in mine.columns:
        a, b = mine[column].to_numpy(), shipped[column].to_numpy()
        if a.dtype.kind in "fi":
            np.testing.assert_allclose(a.astype(float), b.astype(float), rtol=RTOL, atol=0, err_msg=what)
        else:
            assert a.tolist() == b.tolist(), (what, column)


def test_the_recipe_reproduces_the_first_rows_of_the_shipped_run(tmp_path):
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), "--stop-after", str(STEPS)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    meta, shipped_meta = (json.loads((folder / "run.json").read_text()) for folder in (out, SHIPPED))
    assert meta["config"] == shipped_meta["config"] and meta["seed"] == shipped_meta["seed"]
    assert shipped_meta["recipe"] == "python scripts/samples/finetune_modes.py"  # the full run, no flag
    assert all(m["steps_done"] == shipped_meta["config"]["steps"] for m in shipped_meta["modes"].values())
    for name in ("curves", "balance"):
        mine = pd.read_parquet(out / f"{name}.parquet")
        shipped = pd.read_parquet(SHIPPED / f"{name}.parquet")
        assert set(mine["mode"]) == set(shipped["mode"]) == {"router", "experts", "lora", "full"}
        first = shipped[shipped["step"] <= STEPS].reset_index(drop=True)
        assert sorted(set(mine["step"])) == list(range(STEPS + 1))
        _same(mine, first, name)
