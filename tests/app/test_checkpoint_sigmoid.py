"""The z-loss rule on a checkpoint series of sigmoid routers (sample deepseek-v3-bias, two checkpoints):
no z-loss threshold in the timeline, no dashed z-loss line on the Checkpoints page and no z-loss reason in
its verdicts, while a softmax series (mixtral-healthy) keeps its (log E + 8)² line; the score function and
E are told here from each sample's captured router scores."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from tests.support.app import REPO, app_test_env, run_page

SAMPLES = REPO / "sample_models"


def make_series(root: Path, sample: str) -> Path:
    """Two checkpoints of one sample (its files copied, inside `root`): the smallest series a timeline
    takes."""
    series = root / f"{sample}-series"
    for step in ("step-1", "step-2"):
        shutil.copytree(SAMPLES / sample, series / step)
    return series


def router_facts(sample: str) -> tuple[str, int]:
    """(score function, experts) of a sample's first MoE layer, told from its captured router by hand:
    "sigmoid" when its scores are sigmoid(logits) per expert, "softmax" when they are softmax(logits)."""
    import moeviz

    routing = moeviz.capture(moeviz.load_model(str(SAMPLES / sample)), "One two three four.").layers[0]
    logits = routing.logits.astype(np.float64)
    softmax = np.exp(logits - logits.max(1, keepdims=True))
    softmax /= softmax.sum(1, keepdims=True)
    if np.allclose(routing.scores, 1 / (1 + np.exp(-logits)), atol=1e-5):
        return "sigmoid", logits.shape[1]
    assert np.allclose(routing.scores, softmax, atol=1e-5)
    return "softmax", logits.shape[1]


def open_timeline(tmp_path: Path, monkeypatch, sample: str):
    """The Checkpoints page on a local series of `sample`, showing the z-loss indicator."""
    from components import access

    series = make_series(tmp_path, sample)
    app_test_env(monkeypatch)
    monkeypatch.setenv("MOEVIZ_MODEL_DIRS", str(tmp_path))
    return run_page(
        "pages/checkpoints.py",
        timeout_s=240,
        series_choice=access.LOCAL_FOLDER,
        series_folder=str(series),
        timeline_indicator="z_loss",
    )


def z_loss_rules(at) -> list[float]:
    """The thresholds the z-loss balance chart draws as dashed rules."""
    (chart,) = [c for c in at.get("vega_lite_chart") if "router z-loss" in c.proto.spec]
    rules = []
    for data in chart.proto.datasets:
        rows = pa.ipc.open_stream(data.data.data).read_all().to_pylist()
        rules += [r["threshold"] for r in rows if "threshold" in r and "checkpoint" not in r]
    return rules


@pytest.fixture(autouse=True)
def _app_importable(monkeypatch):
    app_test_env(monkeypatch)


def test_sigmoid_series_draws_no_z_loss_line_and_gives_no_z_loss_verdict(tmp_path, monkeypatch) -> None:
    score_fn, _ = router_facts("deepseek-v3-bias")
    assert score_fn == "sigmoid"
    at = open_timeline(tmp_path, monkeypatch, "deepseek-v3-bias")
    assert z_loss_rules(at) == []
    tables = [t.value for t in at.dataframe]
    crossings = next(t for t in tables if "indicator" in t and "threshold" in t)
    assert "z_loss" not in set(crossings["indicator"])
    assert any("No z-loss threshold" in c.value for c in at.caption)


def test_softmax_series_keeps_its_z_loss_line(tmp_path, monkeypatch) -> None:
    score_fn, experts = router_facts("mixtral-healthy")
    assert score_fn == "softmax"
    at = open_timeline(tmp_path, monkeypatch, "mixtral-healthy")
    assert z_loss_rules(at) == pytest.approx([(math.log(experts) + 8) ** 2])
    assert not any("No z-loss threshold" in c.value for c in at.caption)


def test_store_verdicts_apply_the_z_loss_rule_to_softmax_routers_only(tmp_path) -> None:
    """With a threshold every router exceeds (excess −log E nats: z-loss > 0), the store's verdict warns a
    softmax model's layers of their z-loss and never a sigmoid model's."""
    import moeviz
    from moeviz.analysis.collapse import CollapseThresholds
    from moeviz.samples import write_eval_prefix
    from moeviz.store import StoreQuery, TraceSettings, write_corpus

    found = {}
    for sample in ("deepseek-v3-bias", "mixtral-healthy"):
        score_fn, experts = router_facts(sample)
        low = CollapseThresholds(warning_logit_excess=-math.log(experts))
        loaded = moeviz.load_model(str(SAMPLES / sample))
        corpus = write_eval_prefix(loaded, tmp_path / f"corpus-{sample}", 64)
        store = tmp_path / f"store-{sample}"
        write_corpus(
            loaded, corpus, store, model=sample, settings=TraceSettings(batch_size=1, chunk_tokens=64),
            progress=False,
        )  # fmt: skip
        reasons = StoreQuery(store, model=sample).collapse(low)["reasons"]
        found[score_fn] = reasons.str.contains("z-loss")
    assert not found["sigmoid"].any()
    assert found["softmax"].all()
