"""The sample models' training recipe at toy size, as real subprocesses: corpus (no apt) -> tokenizer -> a few
training steps -> moeviz loads and captures the result. The shipped samples:
tests/models/test_sample_models.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

import moeviz

REPO = Path(__file__).resolve().parents[2]


def test_training_recipe_smoke(tmp_path):
    """The whole recipe at toy size: corpus (no apt) -> tokenizer -> a few training steps -> moeviz."""
    scripts = REPO / "scripts" / "samples"

    def run(*args):
        result = subprocess.run(
            [sys.executable, *map(str, args)], capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]

    run(scripts / "build_corpus.py", "--smoke", tmp_path / "corpus")
    run(
        scripts / "train_tokenizer.py",
        "--corpus",
        tmp_path / "corpus",
        "--out",
        tmp_path / "tok",
        "--vocab-size",
        "300",
    )
    for arch, balance in (("mixtral", "per-layer"), ("deepseek_v3", "bias")):
        out = tmp_path / arch
        run(scripts / "train_model.py", "--corpus", tmp_path / "corpus", "--tokenizer", tmp_path / "tok",
            "--out", out, "--arch", arch, "--balance", balance, "--steps", "3", "--small", "--seq", "32",
            "--batch", "4", "--checkpoints", "0")  # fmt: skip
        trace = moeviz.capture(moeviz.load_model(out / "final"), "hello world")
        assert trace.layers and (out / "checkpoints" / "step-00000" / "config.json").is_file()
        if balance == "bias":  # the bias moved during training
            assert all(np.abs(layer.bias).max() > 0 for layer in trace.layers)
