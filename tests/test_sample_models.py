"""The shipped sample models: they load and generate offline, and their cards tell the truth."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

import moeviz
from moeviz.models.loading import sample_models_dir
from moeviz.samples import measure_sample

from .conftest import REPO

MODELS = ["mixtral-healthy", "mixtral-unbalanced", "mixtral-collapsed", "deepseek-v3-bias"]
SERIES = "mixtral-healthy-series"


@pytest.fixture(scope="module", params=MODELS)
def measured(request):
    loaded = moeviz.load_model(f"sample:{request.param}")
    card = json.loads((sample_models_dir() / request.param / "routing_stats.json").read_text())
    return request.param, loaded, card, measure_sample(loaded)


def test_loads_and_generates_offline(measured):
    _, loaded, _, _ = measured
    prompt = loaded.tokenizer("In the beginning", return_tensors="pt")
    with torch.inference_mode():
        out = loaded.model.generate(**prompt, max_new_tokens=12, do_sample=False)
    new = loaded.tokenizer.decode(out[0, prompt["input_ids"].shape[1] :])
    assert out.shape[1] > prompt["input_ids"].shape[1] and new.strip()


def test_card_numbers_are_reproduced(measured):
    """The routing statistics in routing_stats.json (and the README table made from it) are what moeviz
    measures now on the committed evaluation slices (same protocol; CPU results are deterministic, the
    tolerance covers BLAS differences between machines)."""
    name, _, card, now = measured
    assert now["tokens"] == card["tokens"]
    assert now["parameters_total"] == card["parameters_total"]
    for got, want in zip(now["layers"], card["layers"], strict=True):
        assert got["layer"] == want["layer"]
        for key in ("load_entropy", "max_share", "domain_mi_bits"):
            assert got[key] == pytest.approx(want[key], abs=2e-3), f"{name} layer {got['layer']} {key}"
        assert got["dead_experts"] == want["dead_experts"], name
        assert got["verdict"] == want["verdict"], name
    for domain, loss in card["heldout_loss_nats"].items():
        assert now["heldout_loss_nats"][domain] == pytest.approx(loss, abs=1e-2)
    readme = (sample_models_dir() / name / "README.md").read_text()
    for layer in card["layers"]:
        assert f"| {layer['layer']} | {layer['load_entropy']:.3f} | {layer['max_share']:.3f} |" in readme


def test_each_model_shows_what_its_card_claims(measured):
    name, _, _, now = measured
    layers = now["layers"]
    if name == "mixtral-healthy":
        assert all(r["load_entropy"] > 0.9 and r["dead_experts"] == 0 for r in layers)
        assert all(r["verdict"] == "healthy" for r in layers)
    elif name == "mixtral-collapsed":
        assert sum(r["verdict"] == "collapsed" for r in layers) >= 2
    elif name == "mixtral-unbalanced":
        healthy = json.loads((sample_models_dir() / "mixtral-healthy" / "routing_stats.json").read_text())
        assert min(r["load_entropy"] for r in layers) < min(r["load_entropy"] for r in healthy["layers"])
    elif name == "deepseek-v3-bias":
        assert now["bias"] and all(b["bias_max_abs"] > 0 for b in now["bias"])
        assert any(b["changed_selection_share"] > 0 for b in now["bias"])
    # Real specialisation: domain information in routing above the shuffled-label baseline somewhere.
    assert max(r["domain_mi_bits"] - r["domain_mi_null"] for r in layers) > 0.05


def test_checkpoint_series():
    names = [n for n in moeviz.list_samples() if n.startswith(f"{SERIES}/")]
    steps = [int(n.split("step-")[1]) for n in names]
    assert len(steps) >= 6 and steps[0] == 0 and steps == sorted(steps)
    final = moeviz.capture(moeviz.load_model(f"sample:{names[-1]}"), "In the beginning God created")
    healthy = moeviz.capture(moeviz.load_model("sample:mixtral-healthy"), "In the beginning God created")
    for a, b in zip(final.layers, healthy.layers, strict=True):
        np.testing.assert_array_equal(a.experts, b.experts)


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
