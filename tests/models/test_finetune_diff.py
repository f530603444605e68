"""Base vs fine-tuned on the same tokens (moeviz.analysis.finetune_diff, `moeviz finetune-diff`): every number
against a direct computation from the two traces, the adapter file and peft's own merge."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import moeviz
from moeviz.analysis.collapse import collapse_report
from moeviz.analysis.finetune_diff import finetune_diff, load_shift_frame, router_weights
from moeviz.errors import InputError
from tests.support.adapters import FAMILY, save_adapter

TOKENS = [[(7 * i + 3) % 120 + 3 for i in range(96)], [(11 * i + 5) % 120 + 3 for i in range(96)]]
RANK, ALPHA = 4, 8


@pytest.fixture(scope="module")
def sides(tiny_model_dir, tmp_path_factory):
    """(base dir, adapter dir, base trace, tuned trace, base router weights, tuned router weights)."""
    base_dir = tiny_model_dir(FAMILY)
    adapter = save_adapter(tmp_path_factory.mktemp("ft") / "lora", rank=RANK, seed=3)
    base = moeviz.load_model(base_dir, dtype="float32")
    tuned = moeviz.load_model(base_dir, dtype="float32", adapter=adapter)
    traces = moeviz.capture(base, token_ids=TOKENS), moeviz.capture(tuned, token_ids=TOKENS)
    return base_dir, adapter, *traces, router_weights(base), router_weights(tuned)


@pytest.fixture(scope="module")
def result(sides):
    _, _, base, tuned, wb, wt = sides
    return finetune_diff(base, tuned, base_weights=wb, tuned_weights=wt, draws=2000)


def hand_shares(experts: np.ndarray, num_experts: int) -> np.ndarray:
    counts = np.zeros(num_experts)
    for row in experts:
        for e in row:
            if e >= 0:
                counts[e] += 1
    return counts / experts.size


def test_load_shift_and_mismatch_equal_a_direct_comparison(sides, result) -> None:
    _, _, base, tuned, _, _ = sides
    shift = result.load_shift
    for x, y in zip(base.layers, tuned.layers, strict=True):  # one forward each: the same rows
        rows = shift[shift["layer"] == x.layer]
        share_base, share_tuned = hand_shares(x.experts, x.num_experts), hand_shares(y.experts, y.num_experts)
        np.testing.assert_allclose(rows["share_base"], share_base)
        np.testing.assert_allclose(rows["share_tuned"], share_tuned)
        np.testing.assert_allclose(rows["shift"], share_tuned - share_base)
        differ = [set(a) != set(b) for a, b in zip(x.experts.tolist(), y.experts.tolist(), strict=True)]
        layer = result.routing.layers.set_index("layer").loc[x.layer]
        assert layer["mismatched"] == sum(differ) > 0
        assert layer["router_mismatch"] == pytest.approx(np.mean(differ))
    assert not result.routing.nondeterministic  # the adapter makes it another source, not noise


def test_the_bands_are_a_paired_bootstrap(sides, result) -> None:
    """The band edges against a paired bootstrap by hand (the same resampled tokens on both sides)."""
    _, _, base, tuned, _, _ = sides
    rng = np.random.default_rng(7)
    draws, level = 2000, result.level
    for x, y in zip(base.layers, tuned.layers, strict=True):
        n, e = len(x.experts), x.num_experts
        picks = rng.integers(0, n, size=(draws, n))
        spread = (
            np.stack([hand_counts(y.experts[p], e) - hand_counts(x.experts[p], e) for p in picks])
            / x.experts.size
        )
        low, high = np.quantile(spread, [(1 - level) / 2, (1 + level) / 2], axis=0)
        rows = result.load_shift[result.load_shift["layer"] == x.layer]
        np.testing.assert_allclose(rows["shift_low"], low, atol=0.006)
        np.testing.assert_allclose(rows["shift_high"], high, atol=0.006)
        np.testing.assert_array_equal(rows["moved"], (rows["shift_low"] > 0) | (rows["shift_high"] < 0))


def hand_counts(experts: np.ndarray, num_experts: int) -> np.ndarray:
    return np.bincount(experts[experts >= 0], minlength=num_experts)


def test_balance_before_and_after(sides, result) -> None:
    _, _, base, tuned, _, _ = sides
    assert result.verdict_base == collapse_report(base).verdict
    assert result.verdict_tuned == collapse_report(tuned).verdict
    assert result.degraded == (result.verdict_tuned > result.verdict_base)
    for x, y in zip(base.layers, tuned.layers, strict=True):
        row = result.balance.set_index("layer").loc[x.layer]
        assert row["max_share_base"] == pytest.approx(hand_shares(x.experts, x.num_experts).max())
        assert row["max_share_tuned"] == pytest.approx(hand_shares(y.experts, y.num_experts).max())


def test_the_router_delta_is_the_lora_update(sides, result) -> None:
    """‖ΔW‖ of each router equals torch.linalg.norm of (alpha/r)·B·A read from the adapter file, and of
    W_merged − W_base from peft's own merge; its rank is the adapter's."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    base_dir, adapter, *_ = sides
    stored = load_file(adapter / "adapter_model.safetensors")
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    before = {i: layer.mlp.gate.weight.detach().clone() for i, layer in enumerate(base.model.layers)}
    merged = PeftModel.from_pretrained(base, adapter).merge_and_unload()
    delta = result.router_delta.set_index("layer")
    assert len(delta) == len(before)
    for i, w0 in before.items():
        prefix = f"base_model.model.model.layers.{i}.mlp.gate"
        update = (ALPHA / RANK) * stored[f"{prefix}.lora_B.weight"] @ stored[f"{prefix}.lora_A.weight"]
        assert delta.loc[i, "norm"] == pytest.approx(float(torch.linalg.norm(update)), rel=1e-5)
        merged_delta = merged.model.layers[i].mlp.gate.weight.detach().double() - w0.double()
        assert delta.loc[i, "norm"] == pytest.approx(float(torch.linalg.norm(merged_delta)), rel=1e-12)
        assert delta.loc[i, "relative"] == pytest.approx(delta.loc[i, "norm"] / float(torch.linalg.norm(w0)))
        assert delta.loc[i, "rank"] == RANK


def test_an_unchanged_router_has_no_delta_and_no_shift(sides) -> None:
    from moeviz.analysis.finetune_diff import router_delta_frame

    _, _, base, _, wb, _ = sides
    frame = router_delta_frame(wb, wb)
    assert (frame["norm"] == 0).all() and (frame["rank"] == 0).all()
    shift = load_shift_frame(base, base, draws=200)
    assert (shift["shift"] == 0).all() and not shift["moved"].any()
    assert (shift["shift_low"] == 0).all() and (shift["shift_high"] == 0).all()  # paired: no spread at all


def test_traces_of_other_tokens_are_refused(sides) -> None:
    base_dir, _, base, *_ = sides
    other = moeviz.capture(moeviz.load_model(base_dir, dtype="float32"), token_ids=[TOKENS[0][::-1]])
    with pytest.raises(InputError, match="cannot diff these routings"):
        finetune_diff(base, other)


def test_the_command_prints_the_same_numbers(sides, result, capsys) -> None:
    from moeviz.cli import main

    base_dir, adapter, *_ = sides
    ids = ",".join(map(str, TOKENS[0]))
    argv = ["finetune-diff", "--model", str(base_dir), "--adapter", str(adapter), "--token-ids", ids]
    assert main([*argv, "--format", "json", "--draws", "50"]) == 0
    payload = json.loads(capsys.readouterr().out)
    one = finetune_diff(
        *(
            moeviz.capture(moeviz.load_model(base_dir, **kw), token_ids=[TOKENS[0]])
            for kw in ({}, {"adapter": adapter})
        ),
        draws=50,
    )
    assert payload["routing"]["router_mismatch"] == pytest.approx(one.routing.router_mismatch)
    assert [r["shift"] for r in payload["load_shift"]] == pytest.approx(one.load_shift["shift"].tolist())
    norms = [r["norm"] for r in payload["router_delta"]]
    assert norms == pytest.approx(result.router_delta["norm"].tolist())
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "router_delta" in text and f"LoRA r={RANK}" in text and "balance:" in text
    assert main(["finetune-diff", "--model", str(base_dir), "--token-ids", ids]) == 2
    assert "give --adapter DIR" in capsys.readouterr().err
