"""Compare with model A = a LoRA adapter over model B: the "What the fine-tune did" section, its numbers
against `finetune_diff` run here on captures made apart from the app, and the change per domain on the
evaluation corpus after its button (Streamlit AppTest)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

import moeviz
from moeviz.analysis.finetune_diff import finetune_diff, router_weights
from moeviz.samples import DOMAINS, eval_batch
from tests.support.adapters import save_adapter
from tests.support.app import local_tiny_model, run_page

TEXT = "The for statement is used to iterate over the elements of a sequence, such as a string or a list."
SECTION = "What the fine-tune did"


@pytest.fixture
def model_and_adapter(tiny_model_dir, monkeypatch, tmp_path):
    folder = local_tiny_model(tiny_model_dir, monkeypatch, "qwen3_moe")
    adapter = save_adapter(tmp_path / "lora", vocab_size=2048, rank=4, seed=3)  # inside the allowed root
    return folder, adapter


def shown(at, column: str) -> pd.DataFrame:
    (frame,) = [d.value for d in at.dataframe if column in d.value.columns]
    return frame.reset_index(drop=True)


def assert_same(got: pd.DataFrame, expected: pd.DataFrame) -> None:
    pd.testing.assert_frame_equal(
        got.reset_index(drop=True), expected[got.columns].reset_index(drop=True), check_dtype=False
    )


def corpus(loaded: moeviz.LoadedModel) -> tuple[moeviz.Trace, list[str]]:
    """The evaluation corpus routed one capture per domain, and each sequence's domain."""
    batch = eval_batch(loaded)
    parts = [
        moeviz.capture(
            loaded, token_ids=[i for i, d in zip(batch.token_ids, batch.domains, strict=True) if d == x]
        )
        for x in DOMAINS
    ]
    return moeviz.Trace.concat(parts), batch.domains


def test_base_vs_its_lora_shows_what_the_finetune_did(model_and_adapter) -> None:
    folder, adapter = model_and_adapter
    at = run_page("pages/compare.py", timeout_s=300, load_adapter=str(adapter), prompt=TEXT)
    assert SECTION in [h.value for h in at.subheader]  # A = the adapter's key, B = its base by default

    base, tuned = moeviz.load_model(folder), moeviz.load_model(folder, adapter=adapter)
    weights = {"base_weights": router_weights(base), "tuned_weights": router_weights(tuned)}
    expected = finetune_diff(moeviz.capture(base, TEXT), moeviz.capture(tuned, TEXT), **weights)
    metrics = {m.label: m for m in at.metric}
    assert metrics["Router mismatch"].value == f"{expected.routing.router_mismatch:.2%}"
    assert expected.routing.router_mismatch > 0
    moved = expected.moved_experts()
    assert metrics["Experts whose load moved"].value == f"{len(moved):,} of {len(expected.load_shift):,}"
    assert metrics["Balance verdict"].value == f"{expected.verdict_base} → {expected.verdict_tuned}"
    assert_same(shown(at, "sigma_max"), expected.router_delta)
    assert (expected.router_delta["rank"] == 4).all()  # the adapter's rank: the section read its routers
    assert_same(shown(at, "verdict_tuned"), expected.balance)
    if len(moved):
        assert_same(shown(at, "moved"), moved)

    # the cost before the run: one forward per domain and model, priced per token of a timed forward
    tokens = sum(map(len, eval_batch(base).token_ids))
    (cost,) = [c.value for c in at.caption if "Cost: " in c.value]
    assert f"Cost: {2 * len(DOMAINS)} forwards ({2 * tokens:,} tokens) ≈ " in cost
    at.button(key="finetune_corpus").click().run()
    assert not at.exception and not at.error, [e.value for e in [*at.exception, *at.error]]
    (base_corpus, labels), (tuned_corpus, _) = corpus(base), corpus(tuned)
    by_domain = finetune_diff(base_corpus, tuned_corpus, seq_domains=labels, **weights)
    spec = shown(at, "ds_change")
    assert set(spec["domain"]) == set(DOMAINS)
    assert_same(spec, by_domain.specialisation)
    took = by_domain.took_domains()
    assert any(c.value.startswith(f"{len(took):,} (layer, domain, expert) rows") for c in at.caption)
    if len(took):
        assert_same(shown(at, "left"), took)
    np.testing.assert_allclose(spec["ds_change"], spec["ds_tuned"] - spec["ds_base"])


def test_unrelated_models_show_no_finetune_section(model_and_adapter) -> None:
    at = run_page(
        "pages/compare.py", timeout_s=300, compare_b="sample:mixtral-unbalanced", prompt="Hello there"
    )
    assert SECTION not in [h.value for h in at.subheader]
