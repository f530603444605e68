"""moeviz.analysis.lineage: checkpoints of one run read as related, independently trained or initialised
models of the same shape as unrelated, and models of different shapes as unrelated with the reason."""

from __future__ import annotations

import itertools

import pytest

from moeviz.analysis import Lineage, lineage
from moeviz.analysis.lineage import THRESHOLD
from moeviz.models.loading import sample_models_dir
from moeviz.store.checkpoints import resolve_series
from moeviz.testing.tiny_models import build_tiny_model, save_tiny_model

SERIES = sample_models_dir() / "mixtral-healthy-series"


def test_consecutive_checkpoints_of_the_sample_series_are_related() -> None:
    _, checkpoints = resolve_series(SERIES)
    for (_, a), (_, b) in itertools.pairwise(checkpoints):
        result = lineage(a, b)
        assert isinstance(result, Lineage)
        assert result.related and result.checked, (a.name, b.name, result.reason)
        assert len(result.layers) == 4
        assert (result.layers["similarity"] > 0.7).all()  # measured: ≥ 0.75
    widest = lineage(checkpoints[0][1], checkpoints[-1][1])  # step 0 vs 1000: 0.31, still over 0.25
    assert widest.related, widest.reason


def test_separately_trained_samples_are_unrelated() -> None:
    # same config and seed-0 init, but trained separately: the routers diverged (cosine ≤ 0.1 in some layer)
    result = lineage("sample:mixtral-healthy", "sample:mixtral-collapsed")
    assert not result.related
    assert "MoE layer" in result.reason and f"< {THRESHOLD}" in result.reason


def test_independently_initialised_models_are_unrelated_and_a_model_is_related_to_itself() -> None:
    a, b = build_tiny_model("mixtral", seed=0), build_tiny_model("mixtral", seed=1)
    result = lineage(a, b)
    assert not result.related
    assert result.threshold == THRESHOLD == 0.25
    assert (result.layers["similarity"].abs() < 0.15).all()  # random inits: cosine about 0
    same = lineage(a, a.state_dict())  # a module against its own state dict (no config on that side)
    assert same.related
    assert same.layers["similarity"].to_numpy() == pytest.approx(1.0)


def test_a_saved_folder_reads_like_the_module(tmp_path) -> None:
    folder = save_tiny_model("qwen3_moe", tmp_path / "q", seed=0)
    assert lineage(folder, build_tiny_model("qwen3_moe", seed=0)).related
    assert not lineage(folder, build_tiny_model("qwen3_moe", seed=3)).related


def test_different_shapes_are_unrelated_with_the_reason() -> None:
    base = build_tiny_model("mixtral", seed=0)
    experts = lineage(base, build_tiny_model("mixtral", seed=0, num_local_experts=4))
    assert not experts.related and "different experts: 8 vs 4" in experts.reason
    top_k = lineage(base, build_tiny_model("mixtral", seed=0, num_experts_per_tok=1))
    assert not top_k.related and "top-k" in top_k.reason
    layers = lineage(base, build_tiny_model("mixtral", seed=0, num_hidden_layers=3))
    assert not layers.related and "layers" in layers.reason
    family = lineage("sample:mixtral-healthy", "sample:deepseek-v3-bias")
    assert not family.related and "model type" in family.reason


def test_the_threshold_decides(monkeypatch) -> None:
    # the widest span of the series (similarity ≈ 0.31) is related at 0.25 and not at a stricter 0.5
    _, checkpoints = resolve_series(SERIES)
    a, b = checkpoints[0][1], checkpoints[-1][1]
    assert lineage(a, b).related
    strict = lineage(a, b, threshold=0.5)
    assert not strict.related and strict.threshold == 0.5 and "< 0.5" in strict.reason
