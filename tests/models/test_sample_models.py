"""The shipped sample models: they load and generate offline, and their cards tell the truth. The training
recipe: tests/system/test_sample_recipe.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import moeviz
from moeviz.models.loading import sample_models_dir
from moeviz.samples import measure_sample

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
    n = prompt["input_ids"].shape[1]
    with torch.inference_mode():
        out = loaded.model.generate(**prompt, max_new_tokens=12, do_sample=False)
        # greedy decoding (with its KV cache) picks the argmax of one plain forward over the same tokens
        logits = loaded.model(input_ids=out[:, :-1]).logits[0, n - 1 :]
    assert out.shape[1] == n + 12
    assert out[0, n:].tolist() == logits.argmax(-1).tolist()
    assert loaded.tokenizer.decode(out[0, n:]).strip()


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
